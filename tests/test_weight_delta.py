"""The delta codec and the version chain (``inference.weight_sync: delta``), without vLLM: real
weights of a small Llama-layout model after real AdamW steps, and the real S3 server (moto)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.weights.delta import (
    Change,
    DeltaError,
    TensorEntry,
    apply_change,
    decode_frame,
    encode_version,
    frame_of,
    tensor_checksum,
    undo_change,
)
from services.weights.delta_chain import PAYLOAD, ChainBroken, ChainReader, ChainWriter
from shared.names import weight_chain_prefix
from shared.settings import S3StorageSettings
from shared.storage import S3Store


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _versions(lr: float, steps: int, served: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """The served-dtype tensors of the model before and after each of ``steps`` AdamW steps
    (fp32 master weights)."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    out = [{k: v.detach().to(served, copy=True) for k, v in model.state_dict().items()}]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small: more threads only contend on a busy machine (20x slower)
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append({k: v.detach().to(served, copy=True) for k, v in model.state_dict().items()})
    finally:
        torch.set_num_threads(threads)
    return out


def _apply(entries, payload, tensors: dict[str, torch.Tensor]) -> None:
    for entry in entries:
        apply_change(tensors[entry.name], decode_frame(entry, frame_of(entry, payload)))


@pytest.mark.parametrize("encoding", ["set", "xor", "set-planes", "xor-planes", "grouped"])
@pytest.mark.parametrize("served", [torch.bfloat16, torch.float32])
def test_deltas_of_real_adamw_steps_apply_bit_for_bit(encoding, served) -> None:
    versions = _versions(1e-5, 3, served)
    held = {k: v.clone() for k, v in versions[0].items()}
    for before, after in zip(versions, versions[1:]):
        entries, payload = encode_version(after, before, encoding)
        assert {e.op for e in entries} == {encoding}
        changed = sum(e.changed for e in entries)
        total = sum(t.numel() for t in after.values())
        # a real step changes some elements; in bf16 not all of them (in fp32 Adam moves every one)
        assert 0 < changed < total if served == torch.bfloat16 else 0 < changed <= total
        _apply(entries, payload, held)
        for entry in entries:
            assert torch.equal(bits(held[entry.name]), bits(after[entry.name])), entry.name
            assert tensor_checksum(held[entry.name]) == entry.checksum
    full_entries, full_payload = encode_version(versions[-1], None, encoding)
    fresh = {k: torch.zeros_like(v) for k, v in versions[-1].items()}
    _apply(full_entries, full_payload, fresh)
    assert all(tensor_checksum(fresh[e.name]) == e.checksum for e in full_entries)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_bits_not_values_decide_what_changed() -> None:
    """-0.0 vs 0.0 and NaN payloads are changes; the result is the new bit pattern."""
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan"), 3.0], dtype=torch.bfloat16)
    new.view(torch.int16)[2] = old.view(torch.int16)[2] ^ 1  # another NaN
    for encoding in ("set", "xor", "set-planes", "xor-planes", "grouped", "smallest"):
        entries, payload = encode_version({"w": new}, {"w": old}, encoding)
        assert entries[0].changed == 3
        held = {"w": old.clone()}
        _apply(entries, payload, held)
        assert torch.equal(bits(held["w"]), bits(new))


@pytest.mark.parametrize("numpy_only", [True, False])
def test_grouped_frames_cross_blocks_and_chunks_and_need_the_old_tensor(monkeypatch, numpy_only) -> None:
    """Positions in the old tensor's order: exact against that tensor across block and chunk edges
    (both made small here), wrong bits (caught by the checksum) against another one; on the numpy
    path and the compiled one (``delta_order_jit``, where numba is installed)."""
    from services.weights import delta_order

    monkeypatch.setattr(delta_order, "BLOCK", 64)
    monkeypatch.setattr(delta_order, "CHUNK", 256)
    monkeypatch.setattr(delta_order, "NUMPY_ONLY", numpy_only)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        old = (torch.randn(1000, generator=g) * torch.logspace(-4, 0, 1000)).to(dtype)
        new = old.clone()
        picked = torch.randperm(1000, generator=g)[:150]
        new[picked] = (old[picked].float() * (1 + 1e-2 * torch.randn(150, generator=g))).to(dtype)
        new[:256] = old[:256]  # a chunk with no change at all
        entries, payload = encode_version({"w": new}, {"w": old}, "grouped")
        [entry] = entries
        assert entry.op == "grouped" and entry.changed == int((bits(old) != bits(new)).sum())
        change = decode_frame(entry, frame_of(entry, payload))
        assert change.op == "ranked"
        held = old.clone()
        apply_change(held, change)
        assert torch.equal(bits(held), bits(new)) and tensor_checksum(held) == entry.checksum
        other = old.flip(0).contiguous()  # another old tensor: resolved to other bits
        apply_change(other, change)
        assert tensor_checksum(other) != entry.checksum
        with pytest.raises(DeltaError, match="beyond"):
            apply_change(old.clone()[:10].contiguous(), change)


def test_the_compiled_grouped_path_writes_and_resolves_what_the_numpy_path_does(monkeypatch) -> None:
    """Same frames, same resolved indices and bits, for bf16 and fp32, blocks with and without
    changes and a short last block, from the numpy code, the compiled kernels and the device path
    (torch ops, run here on the CPU); a frame whose positions repeat is refused, not half resolved."""
    import numpy as np
    import zstandard

    from services.weights import delta_order, delta_order_device, delta_order_jit

    if not delta_order_jit.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(delta_order, "BLOCK", 128)
    compressor = zstandard.ZstdCompressor()
    g = torch.Generator().manual_seed(5)
    for dtype, ints in ((torch.bfloat16, torch.int16), (torch.float32, torch.int32)):
        for size, fraction in ((1000, 0.1), (5000, 0.9), (129, 0.0)):
            old = (torch.randn(size, generator=g) * torch.logspace(-6, 1, size)).to(dtype)
            new = old.clone()
            picked = torch.randperm(size, generator=g)[:int(size * fraction)]
            new[picked] = (old[picked].float() * (1 + 1e-2 * torch.randn(picked.numel(), generator=g))).to(dtype)
            new[128:256] = old[128:256]  # a block with no change
            o, n = old.view(ints).numpy(), new.view(ints).numpy()
            frames = []
            for numpy_only in (True, False):
                monkeypatch.setattr(delta_order, "NUMPY_ONLY", numpy_only)
                frames.append(delta_order.grouped_frame(o, n, compressor))
            assert frames[0] == frames[1]
            changed = int(np.count_nonzero(o != n))
            assert frames[0][0] == changed
            entry = TensorEntry("w", str(dtype).removeprefix("torch."), (size,), "grouped", changed, 0,
                                len(frames[0][1]), tensor_checksum(new))
            change = decode_frame(entry, frames[0][1])
            resolved = []
            for numpy_only in (True, False):
                monkeypatch.setattr(delta_order, "NUMPY_ONLY", numpy_only)
                resolved.append(delta_order.resolve_ranked(o, change.index.numpy(), change.bits.numpy()))
            assert np.array_equal(resolved[0][0], resolved[1][0]) and np.array_equal(resolved[0][1], resolved[1][1])
            assert resolved[1][1].dtype == o.dtype
            assert np.array_equal(resolved[1][0], np.flatnonzero(o != n))
            assert np.array_equal(resolved[1][1], n[o != n])
        if dtype == torch.bfloat16:  # the device path (torch ops), here on the CPU: the same changed set
            monkeypatch.setattr(delta_order_device, "SPAN", 256)  # spans of 2 blocks
            positions, zigzag = delta_order_device.grouped_changes(old.view(ints), new.view(ints))
            assert np.array_equal(positions, change.index.numpy())
            assert np.array_equal(zigzag, change.bits.numpy().view(zigzag.dtype))
            index, bits = delta_order_device.resolve(old.view(ints), change.index, change.bits)
            assert np.array_equal(index.numpy(), resolved[0][0]) and np.array_equal(bits.numpy(), resolved[0][1])
    positions = np.array([3, 3, 7], dtype=np.int64)  # a repeated position: a corrupt frame
    with pytest.raises(delta_order.OrderError, match="repeat"):
        delta_order.resolve_ranked(o, positions, np.ones(3, dtype=o.dtype))


def test_undo_puts_a_tensor_back_and_a_bad_frame_is_refused() -> None:
    before, after = _versions(1e-4, 1, torch.bfloat16)
    entries, payload = encode_version(after, before, "set")
    entry = next(e for e in entries if e.changed)
    held = before[entry.name].clone()
    undo = apply_change(held, decode_frame(entry, frame_of(entry, payload)))
    assert tensor_checksum(held) == entry.checksum
    undo_change(held, undo)
    assert torch.equal(bits(held), bits(before[entry.name]))
    with pytest.raises(DeltaError, match="does not decompress"):
        decode_frame(entry, b"\x00" * entry.length)
    with pytest.raises(DeltaError, match="full frame"):
        apply_change(held, Change("full", torch.zeros(3, dtype=torch.int16)))


def _store(s3_endpoint: str, run_id: str) -> S3Store:
    store = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing", bucket=run_id))
    store.ensure_bucket()
    return store


def test_chain_on_s3_plans_newest_full_plus_deltas_and_refuses_a_broken_one(s3_endpoint, run_id) -> None:
    store = _store(s3_endpoint, run_id)
    versions = _versions(1e-5, 6, torch.bfloat16)
    writer = ChainWriter(store, run_id, full_every=4)
    kinds = [writer.publish(v, versions[v]).version.kind for v in range(1, 7)]
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta"]
    reader = ChainReader(store, run_id)
    assert [s.version for s in reader.plan(4)] == [1, 2, 3, 4]
    assert [s.version for s in reader.plan(4, have=2)] == [3, 4]
    assert [s.version for s in reader.plan(6, have=2)] == [5, 6]  # a full on the way: from it
    assert reader.plan(6, have=6) == []
    held: dict[str, torch.Tensor] = {}
    for step in reader.plan(4):  # a late joiner: nothing held
        payload = reader.fetch(step)
        for entry in step.tensors:
            change = decode_frame(entry, frame_of(entry, payload))
            if entry.op == "full":
                held[entry.name] = torch.empty(entry.shape, dtype=torch.bfloat16)
            apply_change(held[entry.name], change)
            assert tensor_checksum(held[entry.name]) == entry.checksum
    assert all(torch.equal(bits(held[k]), bits(versions[4][k])) for k in versions[4])
    with pytest.raises(ChainBroken, match="already committed"):
        ChainWriter(store, run_id).publish(6, versions[6])
    # a corrupted payload and a missing one: refused, naming the version
    key = weight_chain_prefix(run_id, 3) + PAYLOAD
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(key, bytes(data))
    with pytest.raises(ChainBroken, match="version 3 .* does not match its manifest"):
        reader.fetch(reader.manifest(3))
    store.client.remove_object(store.bucket, weight_chain_prefix(run_id, 2) + "COMMITTED")
    with pytest.raises(ChainBroken, match="version 2 .* is missing"):
        reader.plan(4, have=1)
    assert [s.version for s in reader.plan(6, have=1)] == [5, 6]


def test_a_format_1_chain_still_reads_and_an_unknown_format_is_refused(tmp_path) -> None:
    import json

    from shared.names import CHECKPOINT_COMMITTED
    from shared.storage import LocalStore

    store, versions = LocalStore(tmp_path), _versions(1e-5, 2, torch.bfloat16)
    writer = ChainWriter(store, "r", encoding="set")  # the ops of format 1
    for v in (1, 2):
        writer.publish(v, versions[v])
    key = weight_chain_prefix("r", 2) + CHECKPOINT_COMMITTED
    manifest = json.loads(store.get_bytes(key))
    assert manifest["format"] == 3

    def rewrite(**fields) -> None:
        store.put_bytes(key, json.dumps({k: v for k, v in {**manifest, **fields}.items() if v is not None}).encode())

    rewrite(format=None)  # as written before the field
    reader = ChainReader(store, "r")
    held = {k: v.clone() for k, v in versions[1].items()}
    step = reader.plan(2, have=1)[0]
    assert step.format == 1
    _apply(step.tensors, reader.fetch(step), held)
    assert all(tensor_checksum(held[e.name]) == e.checksum for e in step.tensors)
    rewrite(format=4)
    with pytest.raises(ChainBroken, match="format 4; this reader knows formats"):
        reader.plan(2, have=1)
    rewrite(format=None, tensors=[{**t, "op": "xor-planes"} for t in manifest["tensors"]])
    with pytest.raises(ChainBroken, match="ops \\['xor-planes'\\] that format does not have"):
        reader.plan(2, have=1)


def test_a_delta_larger_than_the_fraction_is_written_full(tmp_path) -> None:
    from shared.storage import LocalStore

    versions = _versions(1e-2, 2, torch.bfloat16)  # a huge lr: most bf16 elements change
    writer = ChainWriter(LocalStore(tmp_path), "r", full_every=100, max_fraction=0.05)
    assert [writer.publish(v, versions[v]).version.kind for v in (1, 2)] == ["full", "full"]


def test_a_writer_keeping_its_last_version_on_the_device_writes_the_same_chain(tmp_path) -> None:
    """``keep_on_device`` (``inference.weight_sync.encode_on: device``): the same payloads; its last
    version is a copy on the tensors' own device (here the CPU: a GPU takes the device path of
    ``encode_tensor``, tested in ``test_the_compiled_grouped_path_writes_and_resolves_...``)."""
    from shared.storage import LocalStore

    versions = _versions(1e-5, 2, torch.bfloat16)
    payloads = []
    for keep, root in ((False, tmp_path / "host"), (True, tmp_path / "device")):
        writer = ChainWriter(LocalStore(root), "r", keep_on_device=keep)
        published = [writer.publish(v, versions[v]) for v in (1, 2)]
        assert [p.version.kind for p in published] == ["full", "delta"]
        payloads.append([(root / weight_chain_prefix("r", v) / PAYLOAD).read_bytes() for v in (1, 2)])
        assert writer.last is not None
        name = next(iter(versions[2]))
        assert writer.last[name].device == versions[2][name].device
        assert writer.last[name].data_ptr() != versions[2][name].data_ptr()  # a copy: training moves on
    assert payloads[0] == payloads[1]


def test_a_shadow_refuses_a_wrong_base_and_is_left_as_it_was_by_a_checksum_mismatch(tmp_path) -> None:
    from dataclasses import replace

    from services.weights.delta_chain import ChainVersion
    from services.weights.delta_shadow import DeltaChecksumMismatch, DeltaShadow, read_step, write_step

    versions = _versions(1e-4, 2, torch.bfloat16)

    def step_file(version: int, base: int | None, tamper: bool = False, chain: str = "r") -> dict:
        entries, payload = encode_version(versions[version], None if base is None else versions[base], "set")
        if tamper:
            entries[-1] = replace(entries[-1], checksum="0" * 16)
        step = ChainVersion(version, "full" if base is None else "delta", base, "set", len(payload), "", tuple(entries))
        return read_step(write_step(step, payload, tmp_path / f"{version}-{tamper}-{chain}.pt", chain))

    shadow = DeltaShadow()
    with pytest.raises(DeltaError, match="a delta on 0"):
        shadow.apply([step_file(1, 0)])
    shadow.apply([step_file(0, None)])
    assert (shadow.chain, shadow.version) == ("r", 0)
    with pytest.raises(DeltaError, match="holds version 0 of chain r"):
        shadow.apply([step_file(1, 0, chain="other")])
    with pytest.raises(DeltaChecksumMismatch, match="1 tensor"):
        shadow.apply([step_file(1, 0), step_file(2, 1, tamper=True)])
    assert shadow.version == 0
    assert all(torch.equal(bits(shadow.tensors[k]), bits(v)) for k, v in versions[0].items())  # undone
    shadow.apply([step_file(1, 0), step_file(2, 1)])
    assert shadow.version == 2 and all(torch.equal(bits(shadow.tensors[k]), bits(v)) for k, v in versions[2].items())


def _grouped_step(versions: list[dict[str, torch.Tensor]], version: int, base: int | None, tmp_path) -> dict:
    """``versions[version]`` as a read step file of chain "r", ``grouped`` against ``base`` (None: full)."""
    from services.weights.delta_chain import ChainVersion
    from services.weights.delta_shadow import read_step, write_step

    entries, payload = encode_version(versions[version], None if base is None else versions[base], "grouped")
    step = ChainVersion(version, "full" if base is None else "delta", base, "grouped", len(payload), "", tuple(entries))
    return read_step(write_step(step, payload, tmp_path / f"{version}.pt", "r"))


def test_a_shadow_resolves_grouped_frames_before_the_apply_only_on_its_own_base(tmp_path) -> None:
    """``DeltaShadow.resolve`` (what a worker does before the pause) turns one delta on the held
    version into flat ``set`` changes; any other plan is left for the apply to resolve."""
    from services.weights.delta_shadow import DeltaShadow

    versions = _versions(1e-4, 2, torch.bfloat16)

    def step_file(version: int, base: int | None) -> dict:
        return _grouped_step(versions, version, base, tmp_path)

    shadow = DeltaShadow()
    shadow.apply([step_file(0, None)])
    two = [step_file(1, 0), step_file(2, 1)]
    assert shadow.resolve(two) is two  # two steps: the second's base is not held yet
    [resolved] = shadow.resolve([two[0]])
    assert {t["op"] for t in resolved["tensors"]} == {"set"} and shadow.version == 0
    assert all(torch.equal(bits(shadow.tensors[k]), bits(v)) for k, v in versions[0].items())  # untouched
    shadow.apply([resolved])
    assert all(torch.equal(bits(shadow.tensors[k]), bits(v)) for k, v in versions[1].items())
    assert shadow.resolve([two[0]])[0]["tensors"][0]["op"] == "ranked"  # no longer its base
    shadow.apply([two[1]])  # resolved while applying
    assert shadow.version == 2 and all(torch.equal(bits(shadow.tensors[k]), bits(v)) for k, v in versions[2].items())


def test_a_staged_shadow_holds_the_new_version_checked_until_commit_or_rollback(tmp_path) -> None:
    """``DeltaShadow.stage`` (the worker's prebuilt path, before the pause) applies and checks a
    delta without moving the version; ``rollback`` puts the old tensors back, ``commit`` moves the
    version. A tensor assembled from a staged shadow for packing is checked slice by slice against
    the trainer's checksums (``packed_swap``), so a corrupted one is refused."""
    from services.inference.packed_swap import assemble
    from services.weights.delta_shadow import DeltaChecksumMismatch, DeltaShadow

    versions = _versions(1e-4, 1, torch.bfloat16)

    def step_file(version: int, base: int | None) -> dict:
        return _grouped_step(versions, version, base, tmp_path)

    shadow = DeltaShadow()
    shadow.apply([step_file(0, None)])
    delta = shadow.resolve([step_file(1, 0)])
    staged = shadow.stage(delta)
    assert shadow.version == 0 and staged.version == 1 and staged.changed
    assert all(torch.equal(bits(shadow.tensors[k]), bits(v)) for k, v in versions[1].items())
    shadow.rollback(staged)
    assert shadow.version == 0 and all(torch.equal(bits(shadow.tensors[k]), bits(v)) for k, v in versions[0].items())
    staged = shadow.stage(delta)
    names = sorted(n for n in staged.changed if shadow.tensors[n].ndim == 2)[:2]
    fused = assemble("fused", shadow.tensors, names, staged.checksums, None)
    assert torch.equal(bits(fused), bits(torch.cat([versions[1][n] for n in names])))
    flipped = shadow.tensors[names[1]].view(-1).view(torch.int16)
    flipped[0] ^= 1  # one bit, corrupted after the stage's check
    with pytest.raises(DeltaChecksumMismatch, match=names[1]):
        assemble("fused", shadow.tensors, names, staged.checksums, None)
    flipped[0] ^= 1
    shadow.commit(staged)
    assert shadow.version == 1 and all(torch.equal(bits(shadow.tensors[k]), bits(v)) for k, v in versions[1].items())
