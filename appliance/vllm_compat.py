"""vLLM's spellings for ``appliance serve``: byte sizes with suffixes, ``--config FILE.yaml`` and the
``VLLM_*`` environment variables, each mapped onto the appliance's own setting (one home for each
setting: EngineConfig / ServerConfig; this module only translates names and units).

Precedence, highest first: command-line flags, the ``--config`` file, ``APPLIANCE_*`` variables,
``VLLM_*`` variables, defaults.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from appliance.errors import ApplianceError

_GIB = 1 << 30
# vLLM's human-readable integers: lower-case suffixes are decimal, upper-case binary.
_SIZE_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtKMGT]?)\s*$")


def parse_size(flag: str, text: str) -> int:
    """``"4G"`` -> 4 GiB in bytes, ``"4g"`` -> 4e9, ``"1073741824"`` -> itself (vLLM's rules)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ApplianceError(f"{flag}: {text!r} is not a byte count (expected e.g. 4294967296, 4G, 512M, 4g)")
    value = int(float(m.group(1)) * _SIZE_SUFFIX[m.group(2)])
    if value < 1:
        raise ApplianceError(f"{flag} must be >= 1 byte, got {text!r}")
    return value


def bytes_to_gib(n: int) -> float:
    return n / _GIB


MULTI_VALUE_FLAGS = ("--served-model-name", "--api-key")  # vLLM: nargs="+"


def expand_multi_value_flags(args: list[str]) -> list[str]:
    """``MODEL --served-model-name a b`` -> ``MODEL --served-model-name a --served-model-name b``.
    Only when MODEL comes first (vLLM's form): then no other positional can follow, so the extra
    words are unambiguous; otherwise the arguments are left as they are."""
    if not args or args[0].startswith("-"):
        return args
    out, i = [], 0
    while i < len(args):
        a = args[i]
        out.append(a)
        i += 1
        if a in MULTI_VALUE_FLAGS and i < len(args):
            out.append(args[i])
            i += 1
            while i < len(args) and not args[i].startswith("-"):
                out += [a, args[i]]
                i += 1
    return out


# ---- --config FILE.yaml ------------------------------------------------------------------------------

def config_file_values(ctx, path: str) -> dict[str, object]:
    """The values a vLLM-style YAML config file gives ``ctx``'s command, by parameter name, cast to
    the parameter's type. Keys are flag names with ``-`` or ``_`` (``max-model-len``, ``max_model_len``);
    a negative boolean flag (``no-enable-prefix-caching: true``) sets its parameter to False. Only
    parameters not given on the command line are returned (the command line wins)."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ApplianceError(f"--config {path}: cannot read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ApplianceError(f"--config {path}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ApplianceError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")

    # Works with click and with typer's vendored copy of it (duck-typed: no isinstance on click classes).
    keys: dict[str, tuple[object, bool]] = {}  # normalized key -> (parameter, negated)
    for param in ctx.command.params:
        if getattr(param, "param_type_name", "") == "option":
            for opt in param.opts:
                keys.setdefault(opt.lstrip("-").replace("-", "_"), (param, False))
            for opt in param.secondary_opts:
                keys.setdefault(opt.lstrip("-").replace("-", "_"), (param, True))
    for param in ctx.command.params:
        keys.setdefault(param.name, (param, False))

    out: dict[str, object] = {}
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        if norm == "config" or norm not in keys:
            raise ApplianceError(f"--config {path}: unknown key {key!r} (keys are `appliance serve` flag names, "
                                 "e.g. max-model-len; see appliance serve --help)")
        param, negated = keys[norm]
        source = ctx.get_parameter_source(param.name)
        if source is not None and source.name == "COMMANDLINE":
            continue
        if negated:
            if not isinstance(value, bool):
                raise ApplianceError(f"--config {path}: {key!r} must be true or false, got {value!r}")
            value = not value
        multiple = getattr(param, "multiple", False)
        if multiple and not isinstance(value, (list, tuple)):
            value = [value]
        if value is not None and not multiple and isinstance(value, (list, dict)):
            raise ApplianceError(f"--config {path}: {key!r} takes one value, got {value!r}")
        try:
            out[param.name] = None if value is None else param.process_value(ctx, value)
        except Exception as e:  # noqa: BLE001 - click's (or typer's vendored click's) BadParameter
            raise ApplianceError(
                f"--config {path}: bad value {value!r} for {key!r}: {getattr(e, 'message', e)}") from None
    return out


# ---- VLLM_* environment variables --------------------------------------------------------------------

VLLM_ENV = {
    # variable: (what it sets, the appliance equivalent)
    "VLLM_API_KEY": ("api_key", "--api-key / APPLIANCE_API_KEY"),
    "VLLM_CPU_KVCACHE_SPACE": ("kv_cache_memory", "--kv-cache-memory (GiB) / APPLIANCE_KV_CACHE_MEMORY"),
    "VLLM_CPU_OMP_THREADS_BIND": ("omp_threads_bind", "--omp-threads-bind / APPLIANCE_OMP_THREADS_BIND"),
    "VLLM_CPU_NUM_OF_RESERVED_CPU": ("num_threads", "--num-threads (threads = bound cores - reserved)"),
    "VLLM_BATCH_INVARIANT": ("batch_invariant", "--batch-invariant / APPLIANCE_BATCH_INVARIANT"),
}


def vllm_env_engine_kwargs(given: dict, environ=None) -> dict:
    """Engine settings from ``VLLM_CPU_*`` variables, for the keys neither ``given`` (flags, config
    file) nor an ``APPLIANCE_*`` variable sets."""
    env = os.environ if environ is None else environ
    out: dict = {}

    def unset(name: str) -> bool:
        return given.get(name) is None and f"APPLIANCE_{name.upper()}" not in env

    invariant = env.get("VLLM_BATCH_INVARIANT")
    if invariant is not None and unset("batch_invariant"):
        if invariant.strip() not in ("0", "1"):
            raise ApplianceError(f"VLLM_BATCH_INVARIANT must be 0 or 1, got {invariant!r}")
        out["batch_invariant"] = invariant.strip() == "1"
    space = env.get("VLLM_CPU_KVCACHE_SPACE")
    if space and unset("kv_cache_memory"):
        try:
            gib = float(space)
        except ValueError:
            raise ApplianceError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}") from None
        if gib > 0:  # vLLM: 0 or unset means "pick a default"
            out["kv_cache_memory"] = gib
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND")
    if bind and unset("omp_threads_bind"):
        # '|' separates the ranks' lists: one per tensor x data parallel rank
        from appliance.runtime import threads

        ranks = (given.get("tensor_parallel_size") or 1) * (given.get("data_parallel_size") or 1)
        threads.check_rank_lists(bind, ranks, "VLLM_CPU_OMP_THREADS_BIND")
        out["omp_threads_bind"] = bind
    reserved = env.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    if reserved and unset("num_threads"):
        try:
            n = int(reserved)
        except ValueError:
            raise ApplianceError(f"VLLM_CPU_NUM_OF_RESERVED_CPU must be an integer, got {reserved!r}") from None
        if n < 0:
            raise ApplianceError(f"VLLM_CPU_NUM_OF_RESERVED_CPU must be >= 0, got {n}")
        if n:
            from appliance.runtime import threads

            spec = out.get("omp_threads_bind") or given.get("omp_threads_bind") \
                or env.get("APPLIANCE_OMP_THREADS_BIND") or "auto"
            if spec != "nobind":
                # The engine binds one thread per core of its placement; the reserved cores are left
                # out of it (the last ones), and the frontend runs there.
                # One list per rank: every rank keeps its cores minus the reserved ones.
                cores = min(len(threads.resolve(part).cpus or ()) for part in spec.split("|"))
                if n >= cores:
                    raise ApplianceError(f"VLLM_CPU_NUM_OF_RESERVED_CPU={n} leaves no core for the engine "
                                         f"(its placement {spec!r} has {cores})")
                out["num_threads"] = cores - n
    return out


def vllm_env_api_keys(environ=None) -> list[str]:
    env = os.environ if environ is None else environ
    key = env.get("VLLM_API_KEY")
    return [key] if key else []
