"""device_checks: flags computed on the device, read at once, at the end of a scope, or collected
for a graph capture (casebook S14)."""
import pytest
import torch

from amct_ext.runtime import device_checks as DC


class Bad(ValueError):
    pass


def flag(v):
    return torch.tensor([v], dtype=torch.int32)


def test_refuse_if_reads_at_once_outside_a_scope():
    DC.refuse_if(flag(0), [Bad("never")])
    DC.refuse_if(torch.tensor(False), [Bad("never")])          # a bool scalar counts as one flag
    with pytest.raises(Bad, match="second"):
        DC.refuse_if(torch.tensor([0, 3, 1]), [Bad("first"), Bad("second"), Bad("third")])
    with pytest.raises(ValueError, match="2 flags for 1 errors"):
        DC.refuse_if(torch.zeros(2), [Bad("x")])


def test_deferred_scope_raises_the_first_failure_in_call_order_at_its_end():
    seen = []
    with pytest.raises(Bad, match="call 2"):
        with DC.deferred_checks():
            DC.refuse_if(flag(0), [Bad("call 1")])
            DC.refuse_if(flag(1), [Bad("call 2")])
            with DC.deferred_checks():                           # nested: reports to the outer one
                DC.refuse_if(flag(1), [Bad("call 3")])
            seen.append("body finished")                         # nothing raised inside the scope
    assert seen == ["body finished"]
    with DC.deferred_checks():
        DC.refuse_if(torch.tensor([0, 0]), [Bad("a"), Bad("b")])
    # an exception inside the scope propagates; its pending checks are dropped, not read
    with pytest.raises(KeyError):
        with DC.deferred_checks():
            DC.refuse_if(flag(1), [Bad("masked?")])
            raise KeyError("first")
    DC.refuse_if(flag(0), [Bad("the scope was closed")])


def test_raise_first_orders_entries_with_several_flags():
    checks = [(torch.tensor([0, 0], dtype=torch.int32), [Bad("a"), Bad("b")]),
              (torch.tensor([0, 2], dtype=torch.int32), [Bad("c"), Bad("d")]),
              (torch.tensor([5], dtype=torch.int32), [Bad("e")])]
    with pytest.raises(Bad, match="d"):
        DC.raise_first(checks)
    DC.raise_first(checks[:1])


def test_collecting_scope_is_isolated_and_reads_nothing(monkeypatch):
    """A graph capture collects its checks (their flags hold no value until a replay): neither
    read, nor handed to an open deferred scope."""
    with DC.deferred_checks():
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", lambda *a: (_ for _ in ()).throw(AssertionError("read")))
            with DC.collecting_checks() as collected:
                DC.refuse_if(flag(1), [Bad("captured")])
        DC.refuse_if(flag(0), [Bad("outer")])
    assert len(collected) == 1 and collected[0][1][0].args == ("captured",)
    with pytest.raises(Bad, match="captured"):
        DC.refuse_if(torch.cat([f for f, _ in collected]), [e for _, errs in collected for e in errs])
