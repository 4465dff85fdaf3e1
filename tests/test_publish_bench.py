"""`sparrow bench publish`: one sender and two native engines over a real gloo weight group; every version
lands in both engines (their weights equal the sender's after each publication), in the number of buckets
the bucket size gives; impossible requests are refused before any process starts."""

import json

from sparrow.cli.main import main


def test_two_engines_receive_every_version(capsys):
    assert main(["bench", "publish", "--model", "tiny", "--receivers", "2", "--publishes", "2", "--bucket-mb", "0.5",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["publishes"]
    assert [r["version"] for r in rows] == [1, 2] and report["receivers"] == 2
    # tiny: 4 layers, tied embeddings: 2048 x 64 embedding + per layer q, k, v, o, gate, up, down, 4 norms; fp32.
    params = 2048 * 64 + 64 + 4 * (128 * 64 + 64 * 64 * 2 + 64 * 128 + 3 * 64 * 128 + 2 * 64 + 2 * 32)
    assert all(r["bytes"] == 4 * params and r["buckets"] == 3 for r in rows), rows
    assert all(r["weights_match"] for r in rows), "an engine's weights differ from what was sent"
    assert all(r["sender_s"] > 0 and r["slowest_receiver_s"] > 0 for r in rows)


def test_impossible_requests_are_refused(capsys):
    assert main(["bench", "publish", "--model", "tiny", "--receivers", "0"]) == 2
    assert "--receivers=0: must be >= 1" in capsys.readouterr().err
    assert main(["bench", "publish", "--model", "tiny", "--device", "cuda", "--receivers", "7"]) == 2
    assert "needs 8 GPUs" in capsys.readouterr().err
