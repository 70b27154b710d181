"""The driver's side of the vLLM worker extension (`engines.vllm`): calls on every worker of
a `vllm.LLM` through `collective_rpc`; worker errors re-raised as their weighthub error class."""

from __future__ import annotations

import time
from typing import Any

from .. import errors
from ..errors import ApplyError, WeighthubError
from .vote import DONE, PREPARED, commit_margin


def bind(llm: Any, store_url: str, version: int | None = None, *, xor: bool = True,
         stage_dir: str | None = None, peers: tuple[str, ...] = (), secret: bytes = b"",
         node_cache: str | None = None) -> dict[str, Any]:
    """Bind every worker of `llm` (a vllm.LLM) to a store; returns rank 0's result.
    `stage_dir`, `peers`, `secret`, `node_cache`: the chunk sources before the store
    (`weighthub_bind`).

    Raises:
        The weighthub error a worker raised (BaseMismatch, PlacementError, ...).
    """
    return _gather(llm.collective_rpc("weighthub_bind",
                                      args=(store_url, version, xor, stage_dir, peers, secret,
                                            node_cache)))


def stage(llm: Any, version: int | None = None, *, store_url: str | None = None,
          manifest: bytes | None = None, manifest_sha256: str | None = None) -> dict[str, Any]:
    """Fetch, check and decode `version` (default: latest) on every worker of `llm`, weights
    untouched, for the next `refit`; returns rank 0's result (`stage_s`, `bytes_fetched`,
    `relayed_manifest`). `manifest`: `version`'s primary manifest as relayed to this host,
    with the SHA-256 the hub recorded for it (`manifest_sha256`): the workers plan and stage
    from it instead of listing the store and reading its manifest (`weighthub_stage`)."""
    return _gather(llm.collective_rpc("weighthub_stage",
                                      args=(version, store_url, manifest, manifest_sha256)))


def decode_early(llm: Any, version: int) -> dict[str, Any]:
    """Have every worker of `llm` decode `version`'s chunks as they land in its host's node
    cache (`bind(..., node_cache=)`), before the version is committed; the next `stage` of
    `version` takes what they decoded (`Receiver.decode_early`). Returns rank 0's
    {"started": bool}: False without a node cache or a delta to expect."""
    return _gather(llm.collective_rpc("weighthub_decode_early", args=(version,)))


def refit(llm: Any, version: int | None = None, *, store_url: str | None = None,
          vote_timeout_s: float = 60.0) -> dict[str, Any]:
    """Bring every worker of `llm` to `version` (default: latest; or the staged version, if
    `stage` staged one); returns rank 0's result (`stage_s`, `pause_s`, `prestaged`, ...).

    The ranks vote (`engines.vote`): all commit, or all abort and keep serving the previous
    version. A rank left without a decision for `vote_timeout_s` aborts by itself.

    After a commit that changed weights the engine's prefix cache is reset: its KV blocks were
    computed by the previous version, and a prompt sharing a cached prefix would otherwise be
    continued from them. `prefix_cache_reset` in the result is False where vLLM refused
    (requests running): reset it yourself once they end.

    Raises:
        The weighthub error of the first rank that failed (every rank aborted).
    """
    t0 = time.monotonic()
    votes = llm.collective_rpc("weighthub_prepare", args=(version, store_url, vote_timeout_s))
    failed = [(rank, v) for rank, v in enumerate(votes) if v.get("state") not in (PREPARED, DONE)]
    late = time.monotonic() - t0 > vote_timeout_s - commit_margin(vote_timeout_s)
    results = llm.collective_rpc("weighthub_decide", args=(not failed and not late,))
    if late and not failed:
        raise ApplyError(f"the ranks took {time.monotonic() - t0:.1f} s to prepare, too close to "
                         f"the vote's {vote_timeout_s:g} s timeout to commit safely: every rank "
                         "aborted and serves its previous version; raise vote_timeout_s")
    if failed:
        rank, v = failed[0]
        cls = _error_class(v.get("error", ""))
        raise cls(f"rank {rank} of {len(votes)}: {v.get('message', v)}; the vote aborted every "
                  "rank, which serve their previous version")
    result = _gather(results)
    if result.get("route"):  # weights changed
        result["prefix_cache_reset"] = bool(llm.reset_prefix_cache())
    return result


def _gather(results: list[dict[str, Any]]) -> dict[str, Any]:
    for r in results:
        if "error" in r:
            raise _error_class(r["error"])(r["message"])
    return results[0]


def _error_class(name: str) -> type[WeighthubError]:
    """The weighthub error class a worker named (WeighthubError for any other name)."""
    cls = getattr(errors, name, WeighthubError)
    return cls if isinstance(cls, type) and issubclass(cls, WeighthubError) else WeighthubError
