"""What a continuation from text costs at the seam on real answers (issue 49, item 4: "usage may differ from an
uninterrupted run by at most 2 tokens at the seam").

The endpoint backend continues a preempted query by sending the prompt and the partial output's text to
``/v1/completions``, where the server tokenizes them afresh; the partial output's tokens are counted as the pieces
the server streamed. Here, on 400 real answers of the shared data in the default tokenizer (a byte-level BPE
trained on that data, the same on every machine), each cut at a seeded token boundary: the continued prompt's
tokens against the uninterrupted run's prompt and generated tokens, and the pieces a server's incremental decoder
(the ``tokenizers`` ``DecodeStream`` that ``transformers serve`` streams with) sends for them."""

from __future__ import annotations

import random
from collections import Counter

from tokenizers.decoders import DecodeStream

from fleetdata.datasets import load_dataset
from localmodels import default_tokenizer


def test_a_continuation_from_text_differs_from_the_uninterrupted_run_by_at_most_two_tokens():
    tok = default_tokenizer()
    rng = random.Random(0)
    records = [r for r in rng.sample(load_dataset("mixed"), 600) if r.response][:400]
    seam, short = Counter(), Counter()
    for r in records:
        generated = tok.encode(r.response, add_special_tokens=False)
        if len(generated) < 2:
            continue
        k = rng.randint(1, len(generated) - 1)
        stream, pieces = DecodeStream(skip_special_tokens=True), 0
        for t in generated[:k]:
            pieces += bool(stream.step(tok._tokenizer, t))
        text = tok.decode(generated[:k], skip_special_tokens=True)
        continued = len(tok(r.prompt + text)["input_ids"])  # what the server counts as the continued prompt
        seam[continued - (len(tok(r.prompt)["input_ids"]) + k)] += 1
        short[k - pieces] += 1
    n = sum(seam.values())
    assert n >= 350
    assert all(abs(d) <= 2 for d in seam) and seam[0] >= 0.95 * n, seam  # measured: none off
    assert all(0 <= s <= 2 for s in short) and short[0] >= 0.95 * n, (
        short
    )  # measured: 3 cuts in 400 one short
