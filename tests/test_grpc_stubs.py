"""The committed stubs are exactly what `python -m sparrow.protos.generate` produces."""

from pathlib import Path

import pytest

import sparrow.protos
from sparrow.protos import generate


def test_regenerating_stubs_gives_byte_identical_files(tmp_path):
    pytest.importorskip("grpc_tools")
    written = generate.generate(tmp_path)
    committed = Path(sparrow.protos.__file__).parent
    assert sorted(p.name for p in written) == ["sparrow_v1_pb2.py", "sparrow_v1_pb2.pyi", "sparrow_v1_pb2_grpc.py"]
    for path in written:
        assert path.read_bytes() == (committed / path.name).read_bytes(), (
            f"{path.name} differs from a fresh generation; run `python -m sparrow.protos.generate` and commit"
        )


def test_stubs_import_as_a_package():
    from sparrow.protos import sparrow_v1_pb2 as pb
    from sparrow.protos import sparrow_v1_pb2_grpc as pb_grpc

    assert pb.DESCRIPTOR.package == "sparrow.v1"
    assert "from . import sparrow_v1_pb2" in Path(pb_grpc.__file__).read_text()
    assert {s.name for s in pb.DESCRIPTOR.services_by_name.values()} == {"TrajectoryService", "ControlService"}
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["ControlService"].methods}
    assert methods == {"Drain", "Health", "ResizePool"}
    # Statistics, α histograms and schedules travel over Ray inside a job: the wire API has no message for them.
    assert {"StatsReport", "StatsStreamRequest", "AlphaHistogram", "Schedule", "UpdateScheduleRequest"}.isdisjoint(
        pb.DESCRIPTOR.message_types_by_name)
