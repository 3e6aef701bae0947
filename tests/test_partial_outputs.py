"""Issue 49, item 4: what a partial output holds, and how each backend continues one, without a server.

Partial outputs through Redis's encoding; a release that never replaces a longer one; the native engine resuming a
partial output of text only (the endpoint backend writes those) as it would its tokens; what the endpoint backend
sends to continue one (``/v1/completions`` with the prompt, or a chat rendered with the served model's template,
and the partial text) and which rows it starts again; a stop string across the seam. The backend against a real
server: tests/test_endpoint_resume.py."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from transformers import AutoTokenizer

from engines.checkpoints import Checkpoints
from engines.config import EngineConfig
from engines.endpoint_job import ChatRenderer, Job, chat_renderer, stop_across
from engines.endpoint_stream import CHAT_PATH, COMPLETIONS_PATH
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from localmodels import load_or_build
from tests.endpoint_server import chat_model_dir
from workqueue.partial import Partial

MAX_TOKENS = 300
PROMPT = "question 2: how do rivers carve valleys over 5 million years?"


def sampling() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS)


def test_partial_outputs_keep_their_count_through_redis():
    text_only = Partial((), "abc", 2)
    assert len(text_only) == 2 and Partial.decode(text_only.encode()) == text_only
    ids = Partial((1, 2, 3), "xyz")
    assert len(ids) == 3 and Partial.decode(ids.encode()) == ids
    assert Partial.decode('{"token_ids": [4, 5], "text": ""}') == Partial((4, 5))  # written before the count
    assert Partial.decode(Partial().encode()) is None


def test_the_native_engine_continues_a_partial_output_of_text_as_it_would_its_tokens():
    """A partial output with text only (the endpoint backend writes those) resumes from the text's tokens, and the
    native engine's own partial outputs carry their text too, for a backend that continues from text."""
    model, tok = load_or_build(None, arch="llama", size="nano")
    e = LLMEngine(model, tok, EngineConfig(kv_budget_tokens=4096, block_size=4))
    words = " and then the river carved"
    ids = e.tokenizer.encode(words, add_special_tokens=False)
    outs = e.generate(
        [
            Request(f"r{i}", PROMPT, SamplingParams(max_tokens=30), resume=resume)
            for i, resume in enumerate([Partial(tuple(ids)), Partial((), words, len(ids))])
        ]
    )
    assert outs[0].token_ids[: len(ids)] == ids and len(ids) < len(outs[0].token_ids) <= 30
    assert [(o.token_ids, o.text, o.prompt_tokens, o.finish_reason) for o in outs[1:]] == [
        (outs[0].token_ids, outs[0].text, outs[0].prompt_tokens, outs[0].finish_reason)
    ]
    e.add_request(Request("p", PROMPT, SamplingParams(max_tokens=30)))
    for _ in range(6):
        e.step()
    p = e.partial("p")
    assert len(p) == len(p.token_ids) >= 5 and p.text == e.tokenizer.decode(
        list(p.token_ids), skip_special_tokens=True
    )
    assert e.suspend("p") == p and e.partial("p") is None


def body_of(request: Request, chat: ChatRenderer | None = None) -> tuple[str, dict]:
    """What the endpoint backend sends for ``request`` as claimed (its partial output continued where it can be)."""
    return Job.of(request, chat).body("m", True)


def test_a_continued_row_goes_to_completions_for_the_rest_and_a_row_with_tools_starts_again():
    partial = Partial((5, 6, 7), " the Nile", None)
    path, body = body_of(
        Request("p", "Name a river.", sampling(), openai_body={"stop": ["\n\n"]}, resume=partial)
    )
    assert (path, body["prompt"], body["max_tokens"], body["stop"]) == (
        COMPLETIONS_PATH,
        "Name a river. the Nile",
        MAX_TOKENS - 3,
        ["\n\n"],
    )
    # a chat row: continued only with the served model's template to render it (--endpoint-tokenizer)
    chat = {"messages": [{"role": "user", "content": "Name a river."}]}
    row = Request(
        "c", "<|user|>\nName a river.\n<|assistant|>\n", sampling(), openai_body=chat, resume=partial
    )
    path, body = body_of(row)
    assert (path, body["messages"], body["max_tokens"]) == (CHAT_PATH, chat["messages"], MAX_TOKENS)
    tools = {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}
    path, body = body_of(Request("t", row.prompt, sampling(), openai_body=tools, resume=partial))
    assert path == CHAT_PATH and body["max_tokens"] == MAX_TOKENS
    # penalties count the answer's tokens, which a continuation would send as prompt: from the start
    penalised = Request("f", "hi", sampling(), openai_body={"frequency_penalty": 0.5}, resume=partial)
    assert body_of(penalised)[1]["prompt"] == "hi"
    unpenalised = Request("z", "hi", sampling(), openai_body={"presence_penalty": 0}, resume=partial)
    assert body_of(unpenalised)[1]["prompt"] == "hi the Nile"  # a penalty of 0 asks for nothing
    # a partial output of token ids only (a writer that did not decode) is not continued from text
    path, body = body_of(Request("i", "hi", sampling(), resume=Partial((1, 2))))
    assert (body["prompt"], body["max_tokens"]) == ("hi", MAX_TOKENS)


def test_a_chat_continued_through_completions_is_the_prompt_the_server_renders_for_the_chat(tmp_path_factory):
    """The renderer of --endpoint-tokenizer: a template that writes its start token, where the server's
    tokenizer adds one to a completion's prompt too, is sent without it: the tokens are the chat's."""
    tokenizer = AutoTokenizer.from_pretrained(str(chat_model_dir(tmp_path_factory)))
    render = ChatRenderer(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if isinstance(chat_ids, Mapping) else chat_ids)
    assert render.added_start == tokenizer.bos_token and chat_ids[0] == tokenizer.bos_token_id
    assert tokenizer(render(messages))["input_ids"] == chat_ids
    partial = Partial((), " The Nile", 3)
    path, body = body_of(
        Request("c", "", sampling(), openai_body={"messages": messages}, resume=partial), render
    )
    assert (path, body["prompt"], body["max_tokens"]) == (
        COMPLETIONS_PATH,
        render(messages) + " The Nile",
        297,
    )
    # content in text parts: servers join them differently, so the row starts again rather than guess
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    path, body = body_of(
        Request("p", "", sampling(), openai_body={"messages": parts}, resume=partial), render
    )
    assert (path, body["max_tokens"]) == (CHAT_PATH, MAX_TOKENS)
    tokenizer.chat_template = "{{ raise_exception('system messages only') }}"
    assert ChatRenderer(tokenizer)(messages) is None  # a chat the template refuses: from the start


def test_endpoint_tokenizer_errors_name_the_directory(tmp_path, tmp_path_factory):
    with pytest.raises(ValueError, match="--endpoint-tokenizer .*no such directory"):
        chat_renderer(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--endpoint-tokenizer .*cannot load"):
        chat_renderer(str(tmp_path / "empty"))
    AutoTokenizer.from_pretrained(str(chat_model_dir(tmp_path_factory))).save_pretrained(tmp_path / "t")
    plain = AutoTokenizer.from_pretrained(str(tmp_path / "t"))
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="no chat template"):
        chat_renderer(str(tmp_path / "plain"))


def test_a_stop_string_across_the_seam_ends_the_answer_there():
    assert stop_across("The river\n", "\nNext", ["\n\n"]) == ("The river", True)
    assert stop_across("abc EN", "D tail", "END") == ("abc ", True)
    assert stop_across("abc", "def END", ["END"]) == (
        "abcdef END",
        False,
    )  # inside the new text: the server's
    assert stop_across("abc", "def", None) == ("abcdef", False)
    assert stop_across("ab", "cd", ["bc", 3]) == ("a", True) and stop_across("ab", "cd", 5) == ("abcd", False)


def test_a_release_never_writes_a_partial_output_shorter_than_the_one_in_redis():
    """A run that restarted a query (a row it could not continue) and is preempted early gives it back without
    its shorter partial output: the longer one it did not resume from stays for the next run."""
    c = Checkpoints(8)
    c.start("q", 20)  # claimed with 20 tokens in Redis
    c.release("q", Partial((), "abc", 3))
    assert c.for_tick() == [("q", None, True)]
    c.start("r", 20)
    c.release("r", Partial((), "x" * 25, 25))
    assert c.for_tick()[-1] == ("r", Partial((), "x" * 25, 25), True)
