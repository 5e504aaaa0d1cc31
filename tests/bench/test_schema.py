"""The record schema and its validator."""
from __future__ import annotations

import copy

import pytest

from appliance.bench import schema
from appliance.bench.common import new_record, summarize
from appliance.bench.loadgen import RequestResult, level_summary


def serve_record():
    ok = RequestResult(ok=True, ttft=0.1, e2e=0.5, itl=[0.1] * 4, prompt_tokens=8, output_tokens=5, chunks=5,
                       usage_reported=True)
    lv = level_summary([ok, RequestResult(ok=False, error="HTTP 500: x")], 1.0, 2, None)
    return new_record("serve", {"concurrency": [2]}, {"model": "m", "base_url": "u", "endpoint": "chat",
                                                       "levels": [lv]})


def test_valid_record_passes():
    rec = serve_record()
    schema.validate(rec)
    lv = rec["results"]["levels"][0]
    assert lv["failed"] == 1 and lv["completed"] == 1 and lv["tpot_s"]["p50"] == pytest.approx(0.1)


@pytest.mark.parametrize("mutate,where", [
    (lambda r: r["results"]["levels"][0].pop("ttft_s"), "missing key 'ttft_s'"),
    (lambda r: r["results"]["levels"][0].update(failed="1"), "levels[0].failed"),
    (lambda r: r["results"].update(extra=1), "unexpected key 'extra'"),
    (lambda r: r["machine"].pop("cpu"), "machine: missing key 'cpu'"),
    (lambda r: r.update(schema_version=99), "schema_version"),
    (lambda r: r.update(bench="nope"), "bench"),
])
def test_invalid_records_are_rejected(mutate, where):
    rec = copy.deepcopy(serve_record())
    mutate(rec)
    with pytest.raises(schema.SchemaError, match=where.replace("[", r"\[").replace("]", r"\]")):
        schema.validate(rec)


def test_empty_summary_is_null_not_zero():
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert summarize([1.0, 2.0, 3.0, 4.0])["p50"] == 2.5


def test_every_bench_has_a_schema():
    for b in schema.BENCHES:
        s = schema.record_schema(b)
        assert s["properties"]["results"] is schema.RESULTS[b]
