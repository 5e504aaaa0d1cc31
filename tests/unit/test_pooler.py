"""The pooler alone: chunked accumulation against whole-prompt pooling (fp64 torch reference), the
head, and pooler config parsing / sentence-transformers config errors."""
from __future__ import annotations

import json

import pytest
import torch

from appliance.errors import InvalidRequestError, ModelLoadError
from appliance.layers.pooler import (
    Pooler, PoolerConfig, matryoshka_dimensions, parse_pooler_config, resolve_pooler_config,
)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("chunks", [[37], [1, 36], [5, 5, 5, 22], [36, 1]])
def test_chunks_pool_like_the_whole_prompt(kind, chunks):
    torch.manual_seed(0)
    h = torch.randn(37, 24) * 3
    ref = {"LAST": h[-1], "MEAN": h.double().mean(0), "CLS": h[0]}[kind].float()
    p = Pooler(PoolerConfig(kind, normalize=False))
    start, got = 0, None
    for n in chunks:
        out = p.add_chunk("r", start, h[start:start + n], last=start + n == 37)
        assert (out is None) == (start + n < 37)
        got = out if out is not None else got
        start += n
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert not p._state  # nothing kept after the last chunk


def test_restart_from_zero_discards_the_partial_state():
    """A preempted request is recomputed from position 0: the earlier partial sum must not count."""
    h = torch.arange(12.0).view(6, 2)
    p = Pooler(PoolerConfig("MEAN", normalize=False))
    p.add_chunk("r", 0, h[:3] + 100, last=False)
    p.add_chunk("r", 0, h[:3], last=False)
    torch.testing.assert_close(p.add_chunk("r", 3, h[3:], last=True), h.mean(0))


def test_head_cuts_then_normalizes():
    p = Pooler(PoolerConfig("LAST", normalize=True))
    v = torch.tensor([3.0, 4.0, 12.0])
    torch.testing.assert_close(p.head(v, 2, None), torch.tensor([0.6, 0.8]))
    torch.testing.assert_close(p.head(v, None, False), v)


def test_pooler_config_parsing():
    assert parse_pooler_config('{"pooling_type": "mean", "normalize": false}') == {"pooling_type": "MEAN",
                                                                                 "normalize": False}
    for bad, needle in (("{", "not valid JSON"), ('{"pooling_type": "MAX"}', "pooling_type must be one of"),
                        ('{"normalize": "yes"}', "normalize must be true or false"),
                        ('{"softmax": true}', "unsupported field(s) softmax"), ("[1]", "must be a JSON object")):
        with pytest.raises(InvalidRequestError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            parse_pooler_config(bad)


def test_sentence_transformers_config(tmp_path):
    assert resolve_pooler_config(tmp_path, None) == PoolerConfig("LAST", True)  # no modules.json: the default
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert resolve_pooler_config(tmp_path, None) == PoolerConfig("CLS", False)  # no Normalize module
    assert resolve_pooler_config(tmp_path, {"normalize": True}) == PoolerConfig("CLS", True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens"):
        resolve_pooler_config(tmp_path, None)


def test_matryoshka_fields():
    assert matryoshka_dimensions({}) == (False, None)
    assert matryoshka_dimensions({"is_matryoshka": True}) == (True, None)
    assert matryoshka_dimensions({"matryoshka_dimensions": [32, 64]}) == (True, [32, 64])
