"""What the fleet serves, as a submission's rows are checked against it: the models' names and the
OpenAI fields each cluster passes through (what its worker registered, :mod:`workqueue.openai_body`).

A row's ``model`` must be one some cluster serves, where the clusters name theirs (a cluster whose
model has no name, a random model or endpoints not named, takes any). A row carrying an OpenAI field
passed through (``response_format``, ``logprobs``, ``tools``, ...) is refused, naming the field,
when a cluster that could run it cannot honour it: the gateway may assign or move any row to any
active cluster, so each must. Clusters whose worker has not registered yet are not judged (their
worker fails such a row, saying why); removed clusters run nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from workqueue.openai_body import decode_fields, fields_used, parse_body
from workqueue.records import ClusterInfo


@dataclass(frozen=True)
class Serving:
    """The registered clusters' models (``models``: their names; empty: any name) and, by cluster, the
    OpenAI fields each honours (with its backend, for the message)."""

    models: frozenset[str] = frozenset()
    fields: tuple[tuple[str, str, frozenset[str]], ...] = ()  # (cluster, backend, fields honoured)

    @classmethod
    def of(cls, infos: Iterable[ClusterInfo]) -> Serving:
        live = [i for i in infos if i.state != "removed" and i.served_model is not None]
        names = {i.served_model or "" for i in live}
        known = tuple(
            (i.name, i.backend or "?", decode_fields(i.openai_fields))
            for i in live
            if i.openai_fields is not None
        )
        return cls(frozenset() if "" in names else frozenset(names), known)

    def problems(self, raw_body: str) -> list[str]:
        """Why the row with this ``openai_body`` cannot run on the fleet (none when it can)."""
        if not raw_body:
            return []
        try:
            body = parse_body(raw_body)
        except ValueError:
            return []  # validation names that problem
        out = []
        model = body.get("model")
        if model and self.models and model not in self.models:
            out.append(
                f"model {str(model)!r} is served by no cluster (served: {', '.join(sorted(self.models))})"
            )
        used = fields_used(body)
        refusing = [(c, b, sorted(set(used) - have)) for c, b, have in self.fields if set(used) - have]
        if refusing:
            missing = sorted({f for _, _, fs in refusing for f in fs})
            where = ", ".join(f"{c} ({b})" for c, b, _ in refusing)
            out.append(
                f"{', '.join(missing)} cannot be honoured by cluster{'s' if len(refusing) > 1 else ''} {where}: "
                "only the endpoint backend passes OpenAI fields through (engine serve --endpoint-fields)"
            )
        return out
