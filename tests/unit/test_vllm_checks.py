"""engines.vllm_checks.check_committed: a state loaded into an engine must be the committed
version by its manifest's digests, whatever the engine's own bits are now."""

from __future__ import annotations

import pytest
import torch

from weighthub.digest import digest_bits
from weighthub.engines.vllm_checks import check_committed
from weighthub.errors import BaseMismatch
from weighthub.tensors import bits


def _committed() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    gen = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(8, 4, generator=gen).to(torch.bfloat16),
             "b.bias": torch.randn(4, generator=gen).to(torch.bfloat16)}
    return state, {n: digest_bits(bits(t)).hex() for n, t in state.items()}


def test_the_committed_bits_pass_even_when_the_engine_holds_others() -> None:
    state, digests = _committed()
    engine = {n: t.clone() for n, t in state.items()}
    engine["a.weight"].view(torch.int16)[0, 0] ^= 1  # changed outside weighthub, in place
    check_committed(state, engine, digests, "the state given", "version 3")


@pytest.mark.parametrize("change, named", [
    (lambda s: s["b.bias"].view(torch.int16).__ixor__(1), "differs in ['b.bias']"),
    (lambda s: s.__setitem__("a.weight", s["a.weight"].reshape(4, 8)), "differs in ['a.weight']"),
    (lambda s: s.__setitem__("a.weight", s["a.weight"].float()), "differs in ['a.weight']"),
    (lambda s: s.pop("b.bias"), "lacks ['b.bias']"),
    (lambda s: s.__setitem__("c", torch.zeros(2)), "has extra ['c']"),
])
def test_anything_else_is_refused_by_name(change, named) -> None:  # type: ignore[no-untyped-def]
    state, digests = _committed()
    given = {n: t.clone() for n, t in state.items()}
    change(given)
    with pytest.raises(BaseMismatch, match=r"the state given is not version 3: .*"
                       + named.replace("[", r"\[").replace("]", r"\]")):
        check_committed(given, state, digests, "the state given", "version 3")
