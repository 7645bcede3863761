"""Checkpoints whose value blobs were crafted (written through the binding with bytes that
strata.torch never writes), and a state dict whose tensors meet values: every one refused as
a strata error naming the key, before anything of the state dict is changed."""

import pytest
import torch

import strata
import strata.torch as st
from strata import _values

M61 = (1 << 61) - 1   # Python's int hash is the value mod 2^61 - 1


def write(path, blobs, tensors=()):
    """A committed checkpoint holding the tensors {name: tensor} and the blobs {name: bytes}
    as given, through strata's own State and Saver (not strata.torch)."""
    s = strata.State()
    for name, t in dict(tensors).items():
        s.add_shard(name, "f32", tuple(t.shape), data_ptr=t.data_ptr(),
                    nbytes=t.numel() * t.element_size(), keep=t)
    for name, data in blobs.items():
        b = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        s.add_blob(name, data_ptr=b.data_ptr(), nbytes=len(data), keep=b)
    strata.Saver().save([str(path)], [s])


def test_empty_tensor_blob_with_elements_is_refused_before_allocating(tmp_path):
    # an "empty tensor" of 2^40 f32 elements: torch.empty would try 4 TiB
    write(tmp_path / "ck", {"x": _values.encode_empty_tensor("f32", (1 << 20, 1 << 20))})
    sd = {"x": None}
    with pytest.raises(strata.FormatError, match=r"^x: .*shape \[1048576, 1048576\]"):
        st.load(sd, str(tmp_path / "ck"))
    assert sd == {"x": None}
    # a dim past int64, and other dims whose product overflows
    write(tmp_path / "big", {"x": _values.encode_empty_tensor("f32", (0, 1 << 63))})
    with pytest.raises(strata.FormatError, match=r"^x: .*beyond 2\^63"):
        st.load({"x": None}, str(tmp_path / "big"))
    write(tmp_path / "ovf", {"x": _values.encode_empty_tensor("f32", (1 << 40, 1 << 40, 0))})
    with pytest.raises(strata.FormatError, match=r"^x: an empty tensor of shape"):
        st.load({"x": None}, str(tmp_path / "ovf"))


def test_empty_tensor_blob_does_not_fill_a_target_with_elements(tmp_path):
    w = torch.arange(6, dtype=torch.float32)
    write(tmp_path / "ck", {"x": _values.encode_empty_tensor("f32", (4,))}, {"w": w})
    sd = {"w": torch.zeros(6), "x": torch.full((4,), 7.0)}
    with pytest.raises(strata.MismatchError, match=r"^x: .*the target is f32\[4\]"):
        st.load(sd, str(tmp_path / "ck"))
    assert torch.equal(sd["x"], torch.full((4,), 7.0))
    assert torch.equal(sd["w"], torch.zeros(6)), "w was loaded although the load failed"


def colliding_dict_blob(n):
    """A value blob: a dict of n int keys that all hash to 1, values None."""
    out = bytearray(_values.MAGIC_VALUE + b"D")
    _values._varint(out, n)
    for i in range(n):
        _values._enc(out, 1 + i * M61, 1, "")
        out += b"N"
    return bytes(out)


def test_dict_of_colliding_keys_is_refused_in_linear_time(tmp_path):
    # 32,000 such keys took 10 s to decode (each insert compares with every key before it)
    write(tmp_path / "ck", {"d": colliding_dict_blob(32000)})
    sd = {"d": None}
    with pytest.raises(strata.FormatError, match=r"^d: a malformed value: more than 16 dict "
                                                 r"keys of one hash value at byte \d+"):
        st.load(sd, str(tmp_path / "ck"))
    assert sd == {"d": None}
    # up to 16 of one hash load, as saved
    write(tmp_path / "ok", {"d": colliding_dict_blob(16)})
    sd = {"d": None}
    st.load(sd, str(tmp_path / "ok"))
    assert sd["d"] == {1 + i * M61: None for i in range(16)}
    # and strata.torch writes no dict a reader refuses
    with pytest.raises(strata.InvalidArgumentError, match=r"^d: a dict with more than 16 keys "
                                                          r"of one hash value"):
        st.save({"d": {1 + i * M61: i for i in range(17)}}, str(tmp_path / "no"))
    assert not (tmp_path / "no").exists()
    st.save({"d": {1 + i * M61: i for i in range(16)}, "e": {i: i for i in range(5000)}},
            str(tmp_path / "yes"))
    back = {"d": None, "e": None}
    st.load(back, str(tmp_path / "yes"))
    assert back == {"d": {1 + i * M61: i for i in range(16)}, "e": {i: i for i in range(5000)}}


def test_tensor_meeting_a_value_changes_nothing(tmp_path):
    """A tensor target where the checkpoint holds a value is found before the load writes any
    tensor of the state dict (as a shape or dtype mismatch is)."""
    saved = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": 5,
             "c": torch.zeros(0, 3)}
    st.save(saved, str(tmp_path / "ck"))
    for b in (torch.zeros(3), torch.zeros(0)):
        a = torch.full((4, 3), -1.0).t()     # not contiguous: filled through a copy
        sd = {"a": a, "b": b}
        with pytest.raises(strata.MismatchError, match=r"^b: the checkpoint holds a value"):
            st.load(sd, str(tmp_path / "ck"))
        assert torch.equal(a, torch.full((3, 4), -1.0)), "a was overwritten"
        assert sd["b"] is b
    # an empty tensor of another shape, told by its size before the load
    sd = {"a": torch.zeros(3, 4), "c": torch.zeros(0, 300)}
    with pytest.raises(strata.MismatchError, match=r"^c: .*the target is f32\[0, 300\]"):
        st.load(sd, str(tmp_path / "ck"))
    assert torch.equal(sd["a"], torch.zeros(3, 4))
    # one whose blob has the same size is told after the load, from the blob's bytes (a
    # dtype that would round: f32 -> f16; f32 -> f64 widens, empty or not)
    for c in (torch.zeros(3, 0), torch.zeros(0, 3, dtype=torch.float16)):
        with pytest.raises(strata.MismatchError, match=r"^c: the checkpoint holds f32\[0, 3\]"):
            st.load({"a": torch.zeros(3, 4), "c": c}, str(tmp_path / "ck"))
    sd = {"a": torch.zeros(3, 4), "b": 0, "c": torch.zeros(0, 3)}
    st.load(sd, str(tmp_path / "ck"))
    assert torch.equal(sd["a"], saved["a"]) and sd["b"] == 5 and sd["c"].shape == (0, 3)
    sd = {"c": torch.zeros(0, 3, dtype=torch.float64)}
    st.load(sd, str(tmp_path / "ck"))
    assert sd["c"].shape == (0, 3)
