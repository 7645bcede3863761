"""strata.torch where PyTorch's own torch.distributed.checkpoint tests expect DCP's behaviour
(ported in spirit from test/distributed/checkpoint: e2e/test_e2e_save_and_load.py,
test_dtensor_resharding.py, test_tp_checkpoint.py, the e2e tests' BytesIO losses):

  - Stateful objects whose state_dict() / load_state_dict() run collectives, with the keys
    in a different order on every rank (2 and 3 ranks): no hang (one agreed order, sorted);
  - DTensors over a LocalShardsWrapper (the local shards say where they lie, not the
    placements): saved and resharded on load, bitwise;
  - tensors on the meta device in a load's target: replaced by real ones, loaded;
  - an empty dict in a load's target: filled from the checkpoint;
  - io.BytesIO values: stored without pickle, restored with contents and position;
  - non-Stateful entries of the state dict replaced after the load, Stateful ones restored
    through load_state_dict (and left in place);
  - async_save: a tensor changed in place before wait_snapshot() returned is warned of.

The ranks run under _dist.run's timeout: a deadlock fails the test instead of hanging the
suite."""

import io

import pytest
import torch

import strata.torch as st
from strata import _values


# ---- BytesIO values -------------------------------------------------------------------------------

def test_bytesio_round_trips_without_pickle(tmp_path):
    """The e2e tests keep training losses in an io.BytesIO (torch.save'd). Saved without
    pickle=True (a 'B' value), loaded as a new BytesIO with the same bytes and position.
    Before: InvalidArgumentError (needs pickle)."""
    losses = io.BytesIO()
    torch.save([0.5, 0.25], losses)
    pos = losses.tell()
    losses.seek(3)
    path = str(tmp_path / "ck")
    st.save({"losses": losses, "nested": {"b": [io.BytesIO(b"xyz")], "t": torch.ones(2)}}, path)
    tgt = {"losses": io.BytesIO(), "nested": {"b": [None], "t": torch.zeros(2)}}
    st.load(tgt, path)
    got = tgt["losses"]
    assert isinstance(got, io.BytesIO) and got is not losses
    assert got.getvalue() == losses.getvalue() and got.tell() == 3
    got.seek(0)
    assert torch.load(got) == [0.5, 0.25] and pos == len(losses.getvalue())
    assert tgt["nested"]["b"][0].getvalue() == b"xyz" and tgt["nested"]["b"][0].tell() == 0
    assert _values.kind(_values.encode(io.BytesIO(b""))) == "value"


def test_bytesio_encoding_is_the_documented_one():
    b = io.BytesIO(b"\x00\xff" * 70)
    b.seek(200)   # past the end: BytesIO allows it, and pickle keeps it
    enc = _values.encode(b)
    assert enc == b"STV1B" + bytes([140, 1]) + b"\x00\xff" * 70 + bytes([200, 1])
    kind, v = _values.decode(enc)
    assert kind == "value" and v.getvalue() == b.getvalue() and v.tell() == 200
    with pytest.raises(ValueError, match="truncated"):
        _values.decode(b"STV1B\x02ab")   # no position
