"""The committed generated code must match the .proto files."""

from __future__ import annotations

from protos import codegen


def test_generated_code_is_in_sync(tmp_path):
    written = codegen.generate(tmp_path)
    assert written, "protoc wrote nothing"
    for new in written:
        committed = codegen.PROTO_DIR / new.name
        assert committed.exists(), f"{new.name} is generated but not committed; run python -m protos.codegen"
        assert committed.read_bytes() == new.read_bytes(), (
            f"{new.name} is stale; run python -m protos.codegen"
        )


def test_services_are_declared():
    from protos import fleetbatch_pb2 as pb

    assert set(pb.DESCRIPTOR.services_by_name) == {"BatchService", "AdminService"}
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["BatchService"].methods}
    assert methods == {
        "SubmitBatch",
        "SubmitBatchStream",
        "GetBatch",
        "StreamResults",
        "CancelBatch",
        "ListClusters",
    }
