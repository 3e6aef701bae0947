"""One batch service, two fronts: every refusal of the service has a code in each front's own table,
and the codes are those the API promises (never UNKNOWN or a 5xx but 503)."""

from __future__ import annotations

import grpc

from gateway.batches import errors
from gateway.grpc_api.servicer import STATUS
from gateway.http_api.shared import HTTP_STATUS, api_error


def refusals() -> set[type[errors.BatchError]]:
    return {
        v
        for v in vars(errors).values()
        if isinstance(v, type) and issubclass(v, errors.BatchError) and v is not errors.BatchError
    }


def test_every_refusal_has_a_grpc_code_and_an_http_status():
    kinds = refusals()
    assert len(kinds) == 5
    assert set(STATUS) == kinds == set(HTTP_STATUS)
    assert grpc.StatusCode.UNKNOWN not in STATUS.values()
    assert all(400 <= s < 500 or s == 503 for s, _ in HTTP_STATUS.values())


def test_the_fronts_answer_the_same_refusal_in_their_own_terms():
    e = errors.QuotaExceeded("client 'a' has 10 queries queued")
    assert STATUS[type(e)] is grpc.StatusCode.RESOURCE_EXHAUSTED
    http = api_error(e)
    assert (http.status, http.code, http.message) == (429, "resource_exhausted", str(e))
    assert api_error(errors.NotFound("no batch 'x'")).status == 404
