"""Project refit time for large models from measured payload ratios and throughputs.

The model (its assumptions are written into every report):
  dense      = 2 bytes × parameters (bf16)
  payload    = ratio × dense, ratio = measured weighthub payload / dense bytes
  wire       = payload / link (one link, fully used, no protocol overhead)
  encode     = dense / (encode GB/s per core × encoder_cores): every trainer rank diffs its own
               shard on its own core (the default 8 = one node of 8 ranks; more nodes, more cores)
  apply      = dense / (apply GB/s per core × apply_cores) on the receiver, during the pause
  refit      = max(wire, encode) + apply: chunks stream out while later ones are encoding;
               the receiver applies after the last chunk is staged
  full       = dense / link: shipping the whole checkpoint over the same link
The seed's reference point: a 1T-parameter bf16 checkpoint between two regions takes 87.5 min,
i.e. ≈3 Gbit/s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MODEL_SIZES = {"8B": 8e9, "30B": 30e9, "235B": 235e9, "1T": 1e12}
LINKS_GBIT = (1.0, 3.0, 10.0, 100.0)
REFERENCE = "1T bf16 checkpoint between two regions: 87.5 min (≈3 Gbit/s)"


@dataclass(frozen=True, slots=True)
class Assumptions:
    bytes_per_param: int = 2
    encoder_cores: int = 8
    apply_cores: int = 8

    def lines(self) -> list[str]:
        return [
            f"dense = {self.bytes_per_param} bytes × parameters (bf16)",
            "payload = measured weighthub payload ratio × dense",
            "wire = payload / link (one link, fully used, no protocol overhead)",
            f"encode = dense / (measured 1-thread encode GB/s × {self.encoder_cores} cores: each "
            "trainer rank diffs its own shard)",
            f"apply = dense / (measured 1-thread decode+apply GB/s × {self.apply_cores} cores on "
            "the receiver)",
            "refit = max(wire, encode) + apply (chunks stream out while later ones encode; "
            "the receiver applies after staging)",
            "full checkpoint = dense / link",
            f"reference: {REFERENCE}",
        ]


@dataclass(frozen=True, slots=True)
class Projection:
    model: str
    params: float
    link_gbit: float
    ratio: float
    wire_s: float
    encode_s: float
    apply_s: float
    refit_s: float
    full_s: float

    @property
    def speedup(self) -> float:
        return self.full_s / self.refit_s if self.refit_s > 0 else float("inf")

    def to_dict(self) -> dict[str, float | str]:
        d: dict[str, float | str] = asdict(self)
        d["speedup"] = self.speedup
        return d


def project(ratio: float, encode_gbps: float, apply_gbps: float, *,
            assumptions: Assumptions = Assumptions(),
            sizes: dict[str, float] = MODEL_SIZES,
            links: tuple[float, ...] = LINKS_GBIT) -> list[Projection]:
    """Projected refit and full-checkpoint times for every model size and link.

    Args:
        ratio: payload bytes / dense bytes, measured.
        encode_gbps, apply_gbps: measured single-thread GB/s of dense parameter bytes.
    """
    if ratio < 0 or encode_gbps <= 0 or apply_gbps <= 0:
        raise ValueError(f"projection needs ratio >= 0 and positive GB/s, got {ratio}, "
                         f"{encode_gbps}, {apply_gbps}")
    out = []
    for model, params in sizes.items():
        dense = assumptions.bytes_per_param * params
        encode_s = dense / (encode_gbps * 1e9 * assumptions.encoder_cores)
        apply_s = dense / (apply_gbps * 1e9 * assumptions.apply_cores)
        for link in links:
            bps = link * 1e9 / 8
            wire_s = ratio * dense / bps
            refit = max(wire_s, encode_s) + apply_s
            out.append(Projection(model, params, link, ratio, wire_s, encode_s, apply_s, refit,
                                  dense / bps))
    return out
