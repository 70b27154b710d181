"""PublishResult: what one publish did and where its time went."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What one publish did and where its time went (the primary representation only).

    seconds: wall time of `publish` up to and including the commit.
    stream_seconds: wall time of the chunk phase, from the first chunk submitted to the last
        one stored (this rank's chunks, in a group).
    encode_seconds: busy time of change detection, encoding, compression and digest updates,
        summed over the encoder threads.
    encode_cpu_seconds: the CPU time of that work; well below encode_seconds, the encoders
        were preempted (other processes on the cores).
    upload_seconds: busy time of the chunk writes to the store, summed over the threads.
    overlap: (encode_seconds + upload_seconds) / stream_seconds: how many stages were busy at
        once on average. 1.0 is a serial pipeline; it approaches `workers` when every thread
        was always busy, each thread encoding one chunk while another's upload runs. Uploads
        hidden behind encoding show as overlap above 1.
    """

    version: int
    base: int | None
    dense_bytes: int
    payload_bytes: int
    changed: int
    numel: int
    seconds: float
    chunks: int
    stream_seconds: float = 0.0
    encode_seconds: float = 0.0
    upload_seconds: float = 0.0
    encode_cpu_seconds: float = 0.0
    root: str = ""  # the committed version's root digest (hex), as its manifest records it

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def overlap(self) -> float:
        busy = self.encode_seconds + self.upload_seconds
        return busy / self.stream_seconds if self.stream_seconds > 0 else 0.0
