"""Big models in bounded memory. The control worker: a chunked update is read once
into a scratch file while it is checked, then added to the mean piece by piece
(fedq/coordinator/receive.py), and a lean commit steps the stored model piece by piece
(fedq/coordinator/lean.py); the same rounds read whole give the same models bit for
bit, and the same verdict on every update; a refused update leaves nothing behind. A
worker: its update is written as its tensors are made, and it keeps one big model. The
blobs are on a real Redis, in chunks of 4 KB."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from fedq.aggregate import Accumulator
from fedq.aggregate.compression import encode, meta_of
from fedq.blobs import BlobStore, chunks, open_store, update_key
from fedq.blobs.redis import RedisBlobStore
from fedq.blobs.s3 import S3BlobStore
from fedq.coordinator import pipeline
from fedq.coordinator.pipeline import Outcome, reduce
from fedq.protocol.training import UpdateRef
from fedq.spec import JobSpec, parse_spec
from fedq.weights import (
    dump_parts,
    dump_stream,
    dumps,
    encoded_lazily,
    layout,
    loads,
    pieces,
    split_header,
)

CHUNK = 4096
REFERENCE = {"w": torch.zeros(80, 100), "b": torch.zeros(3),
             "n": torch.tensor(0, dtype=torch.int64)}  # integer buffer: float32 on the wire
SPEC: dict[str, Any] = {"model": "small_cnn", "dataset": "digits", "num_clients": 4,
                        "clients_per_round": 4, "rounds": 1, "min_clients": 1}


def _delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(80, 100, generator=g), "b": torch.randn(3, generator=g),
            "n": torch.tensor(1.0)}


def _update(store: BlobStore, client: int, delta: dict[str, torch.Tensor],
            samples: int = 10, codec: str = "none") -> UpdateRef:
    """``delta`` stored as a worker stores it under ``codec`` (int8 in chunks of 256)."""
    if codec == "none":
        blob = store.put_parts(update_key("j", 1, client, 1), dump_parts(delta))
    else:
        size, parts = dump_stream(encoded_lazily(delta, codec, 256), meta_of(codec, 256))
        blob = store.put_stream(update_key("j", 1, client, 1), size, parts)
    return UpdateRef(status="ok", job="j", round=1, client=client, queue="cpu", worker="w",
                     key=blob.key, sha256=blob.sha256, samples=samples, steps=1,
                     bytes_up=blob.size)


def _reduce(spec: JobSpec, store: BlobStore, refs: list[UpdateRef], scratch: Path
            ) -> tuple[dict[str, torch.Tensor] | None, Outcome]:
    outcome = Outcome()
    delta = reduce(spec, store, refs, REFERENCE, outcome, scratch, Accumulator())
    return (None if delta is None else {k: v.clone() for k, v in delta.items()}), outcome


def test_pieces_cover_every_element_however_the_bytes_arrive() -> None:
    g = torch.Generator().manual_seed(1)
    weights = {"a": torch.randn(7, 3, generator=g), "h": torch.randn(5, generator=g).half(),
               "z": torch.zeros(0), "d": torch.randn(4, generator=g).double(),
               "i": torch.arange(6)}
    data = dumps(weights)
    rng = random.Random(0)
    cuts, at = [], 0
    while at < len(data):  # pieces of 1..13 bytes: the header and elements split
        n = rng.randint(1, 13)
        cuts.append(data[at:at + n])
        at += n
    lay, body = split_header(iter(cuts), len(data))
    assert lay == layout(data, len(data))
    got: dict[str, list[torch.Tensor]] = {}
    for entry, first, values in pieces(lay.by_offset(), body, most=12):
        assert first == sum(v.numel() for v in got.get(entry.name, []))
        assert values.nbytes <= 12
        got.setdefault(entry.name, []).append(values)
    for name, tensor in loads(data).items():
        joined = torch.cat(got[name]) if name in got else torch.empty(0, dtype=tensor.dtype)
        assert torch.equal(joined, tensor.reshape(-1)), name


class Stores(NamedTuple):
    kind: str
    streamed: BlobStore  # reads in pieces of 4 KB
    whole: BlobStore  # the same blobs, read whole
    read: list[str]  # the keys ``whole``-style reads (``get``) asked for on ``streamed``


@pytest.fixture(params=["redis", "local", "s3"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
    """Each store twice over the same blobs: one that reads anything over 4 KB in
    pieces (Redis: chunks; a file or an S3 object: pieces of it), one that reads whole."""
    if request.param == "redis":
        url = request.getfixturevalue("redis_db")
        streamed: BlobStore = open_store(url, chunk_bytes=CHUNK)
        whole: BlobStore = RedisBlobStore(url, chunk_bytes=None)
    else:
        if request.param == "local":
            url, endpoint = str(tmp_path / "blobs"), None
        else:
            url = f"s3://fedq/t-{tmp_path.name}"
            endpoint = request.getfixturevalue("s3_env")["FEDQ_S3_ENDPOINT_URL"]
        streamed, whole = open_store(url, endpoint), open_store(url, endpoint)
        streamed.read_piece_bytes = CHUNK
        whole.read_piece_bytes = None
        streamed.prepare()
    assert streamed.piece_bytes == CHUNK and whole.piece_bytes is None
    read: list[str] = []
    real_get = streamed.get

    def get(ref: Any, limit: int | None = None) -> bytes:
        read.append(ref.key)
        return real_get(ref, limit)

    streamed.get = get  # type: ignore[method-assign]
    return Stores(request.param, streamed, whole, read)


@pytest.mark.parametrize(("codec", "clip"), [("none", None), ("fp16", None), ("int8", None),
                                           ("int8", 40.0)])
def test_a_big_update_is_received_in_pieces_and_averaged_bit_for_bit(
        codec: str, clip: float | None, stores: Stores, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncompressed, fp16 and int8 updates (decoded piece by piece), and clipped ones."""
    # Prepare: three big updates; a store that streams them and one that reads whole
    refs = [_update(stores.streamed, c, _delta(c), samples=10 + c, codec=codec)
            for c in range(3)]
    assert all(r.blob.size > CHUNK for r in refs)
    received: list[str] = []
    files: list[Any] = []
    real = pipeline.receive

    def spy(store: BlobStore, ref: UpdateRef, *args: Any) -> Any:
        received.append(ref.key)
        got = real(store, ref, *args)
        files.append(got.fh)
        return got

    monkeypatch.setattr(pipeline, "receive", spy)
    spec = parse_spec({**SPEC, "clip_norm": clip})
    # Execute
    a, streamed_outcome = _reduce(spec, stores.streamed, refs, tmp_path / "s1")
    b, whole_outcome = _reduce(spec, stores.whole, refs, tmp_path / "s2")
    # Assert: received in pieces (never read whole), the same delta bit for bit (when
    # clipped: each update's scale from its norm, equal to float32 rounding), the
    # same records, and each scratch file closed
    assert received == [r.key for r in refs] and stores.read == []
    assert a is not None and b is not None
    for k in REFERENCE:
        assert torch.equal(a[k], b[k]) if clip is None else \
            torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7), k
    if clip is not None:  # clipped: the mean of three updates of norm 40 at most
        assert all(r.norm and r.norm > clip for r in streamed_outcome.records)
        assert float(torch.linalg.vector_norm(a["w"])) <= clip * 1.0001
    assert [(r.status, r.raw_bytes) for r in streamed_outcome.records] == \
        [(r.status, r.raw_bytes) for r in whole_outcome.records]
    # a tensor over several pieces: its norm from theirs, equal to float32 rounding
    assert [r.norm for r in streamed_outcome.records] == \
        pytest.approx([r.norm for r in whole_outcome.records], rel=1e-6)
    assert len(files) == 3 and all(fh.closed for fh in files)  # (and they had no name)
    assert not list((tmp_path / "s1").iterdir())


def _corrupt(stores: Stores, ref: UpdateRef) -> None:
    """One byte changed: Redis's second chunk, a file's or an object's last byte (what
    else a manifest may say is refused as tests/test_blobs.py shows, read whole or in
    pieces)."""
    store = stores.whole
    key = chunks.chunk_key(ref.key, 1) if stores.kind == "redis" else ref.key
    good = store._read(key)
    store._write(key, bytes(good[:-1]) + bytes([good[-1] ^ 1]))


@pytest.mark.parametrize(("case", "make", "spoil", "reason"), [
    ("corrupted bytes", _delta, _corrupt, r"digest mismatch"),
    ("non-finite value", lambda s: {**_delta(s), "b": torch.tensor([0.0, math.nan, 1.0])},
     None, r"tensor 'b' has non-finite values"),
    ("wrong shape", lambda s: {**_delta(s), "w": torch.zeros(100, 80)}, None,
     r"tensor 'w' has shape \(100, 80\), expected \(80, 100\)"),
    ("missing tensor", lambda s: {k: v for k, v in _delta(s).items() if k != "b"}, None,
     r"missing tensor 'b'"),
    ("norm over the bound", lambda s: {k: v * 100 for k, v in _delta(s).items()}, None,
     r"update norm \S+ exceeds max_update_norm 500"),
])
def test_a_bad_big_update_is_refused_in_one_line_and_the_round_goes_on(
        case: str, make: Any, spoil: Any, reason: str, stores: Stores,
        tmp_path: Path) -> None:
    # Prepare: a good update, a bad one, a good one
    refs = [_update(stores.streamed, 0, _delta(0)), _update(stores.streamed, 1, make(1)),
            _update(stores.streamed, 2, _delta(2))]
    if spoil is not None:
        spoil(stores, refs[1])
    spec = parse_spec({**SPEC, "max_update_norm": 500})
    # Execute
    a, outcome = _reduce(spec, stores.streamed, refs, tmp_path / "s1")
    b, whole_outcome = _reduce(spec, stores.whole, refs, tmp_path / "s2")
    good, _ = _reduce(spec, stores.whole, [refs[0], refs[2]], tmp_path / "s3")
    # Assert: refused with one line, as the whole read refuses it; the delta is the two
    # good updates' (bit for bit the whole read's); nothing left in the scratch folder
    assert stores.read == []
    statuses = [r.status for r in outcome.records]
    assert statuses == ["ok", "rejected", "ok"], (case, outcome.records)
    error = outcome.records[1].error or ""
    assert "\n" not in error and re.search(reason, error), (case, error)
    assert whole_outcome.records[1].status == "rejected"
    assert re.search(reason, whole_outcome.records[1].error or ""), whole_outcome.records[1]
    assert a is not None and b is not None and good is not None
    for k in REFERENCE:
        assert torch.equal(a[k], b[k]), (case, k)  # the same operations either way
        assert torch.allclose(a[k], good[k], atol=1e-6), (case, k)  # without the bad one
    assert not list((tmp_path / "s1").iterdir())


def _int8(seed: int, change: Any = None, chunk: str = "256") -> bytes:
    """An int8 update as a worker encodes it, ``change`` applied to its stored tensors."""
    stored, meta = encode(_delta(seed), "int8", 256)
    if change is not None:
        change(stored)
    return dumps(stored, {**meta, "fedq.chunk": chunk})


def _scale(value: float) -> Any:
    def change(stored: dict[str, torch.Tensor]) -> None:
        stored["w.__s"][1] = value
    return change


@pytest.mark.parametrize(("case", "blob", "reason"), [
    ("an infinite scale", _int8(1, _scale(math.inf)), r"tensor 'w' has non-finite values"),
    ("a scale that overflows float32 when decoded", _int8(1, _scale(3e38)),
     r"tensor 'w' has non-finite values"),
    ("another chunk than the job's", _int8(1, chunk="128"),
     r"codec: int8 chunk '128', the job's is 256"),
    ("too few scales", _int8(1, lambda s: s.update({"w.__s": s["w.__s"][:-1]})),
     r"tensor 'w.__s' has shape \(31,\), expected \(32,\)"),
    ("float values where int8 ones go", _int8(1, lambda s: s.update(
        {"w.__q": s["w.__q"].float()})), r"tensor 'w.__q' has dtype torch.float32"),
])
def test_a_bad_int8_update_is_refused_in_pieces_in_one_line(
        case: str, blob: bytes, reason: str, stores: Stores, tmp_path: Path) -> None:
    """An int8 update received in pieces is checked as a whole read checks it: its
    scales and decoded values finite, its chunk the job's, its tensors as the codec
    stores them; a refused one leaves the round to the others."""
    refs = [_update(stores.streamed, 0, _delta(0), codec="int8"),
            _update(stores.streamed, 2, _delta(2), codec="int8")]
    key = update_key("j", 1, 1, 1)
    put = stores.streamed.put(key, blob)
    refs.insert(1, UpdateRef(status="ok", job="j", round=1, client=1, queue="cpu",
                             worker="w", key=put.key, sha256=put.sha256, samples=10,
                             steps=1, bytes_up=put.size))
    spec = parse_spec(SPEC)
    a, outcome = _reduce(spec, stores.streamed, refs, tmp_path / "s1")
    _, whole_outcome = _reduce(spec, stores.whole, refs, tmp_path / "s2")
    assert stores.read == []
    assert [r.status for r in outcome.records] == ["ok", "rejected", "ok"], outcome.records
    error = outcome.records[1].error or ""
    assert "\n" not in error and re.search(reason, error), (case, error)
    assert whole_outcome.records[1].status == "rejected", whole_outcome.records[1]
    assert a is not None and not list((tmp_path / "s1").iterdir())


MODEL = {"w": torch.randn(40, 50, generator=torch.Generator().manual_seed(7)),
         "h": torch.linspace(-1, 1, 300).half(), "b": torch.ones(3),
         "n": torch.tensor(5, dtype=torch.int64)}


def _model_delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 50, generator=g) * 0.1,
            "h": (torch.randn(300, generator=g) * 0.01).half(),
            "b": torch.randn(3, generator=g), "n": torch.tensor(1.0)}


@pytest.mark.parametrize("server", ["fedavg", "diloco", "fedadam"])
def test_a_lean_commit_steps_the_stored_model_piece_by_piece_bit_for_bit(
        server: str, stores: Stores, tmp_path: Path) -> None:
    """Two rounds committed the lean way (the global model's outline, the server step
    read piece by piece from the stored model into the accumulator) and the whole-model
    way give the same models and server state, bit for bit; the lean one never reads
    the global model or the server state whole and keeps nothing for the next round."""
    from fedq.coordinator import commit, lean
    from fedq.weights import dumps as dump

    spec = parse_spec({**SPEC, "eval_every": 0, "server": {"name": server}})
    results: dict[bool, list[Any]] = {}
    buffered: list[str] = []  # keys read whole into one buffer (the worker's read)
    real_buffer = stores.streamed.get_buffer

    def get_buffer(ref: Any, limit: int | None = None) -> bytearray:
        buffered.append(ref.key)
        return real_buffer(ref, limit)

    stores.streamed.get_buffer = get_buffer  # type: ignore[method-assign]
    for is_lean in (True, False):
        store = stores.streamed if is_lean else stores.whole
        model = store.put_parts(f"jobs/{server}{is_lean}/r00000/global", dump_parts(MODEL))
        state = None
        rounds = []
        for number in (1, 2):
            refs = [_update(store, c + 10 * number, _model_delta(c + 10 * number))
                    for c in range(2)]
            assert lean.applies(spec, store.piece_bytes, model.size) == is_lean
            stores.read.clear()
            current = lean.outline(store, model) if is_lean else commit.current_model(store, model)
            new = commit.aggregate(spec, store, f"{server}{is_lean}", number, refs, current,
                                   model.sha256, state, Outcome(), tmp_path / "s",
                                   Accumulator(), source=model if is_lean else None)
            assert new is not None
            if is_lean:  # neither the model nor the state is read whole
                assert model.key not in stores.read, stores.read
                assert not buffered and (state is None or state.key not in stores.read)
            assert new.keep != is_lean
            rounds.append((dump(new.weights), None if new.state is None
                           else bytes(store.get(new.state))))
            model, state = new.blob, new.state
        results[is_lean] = rounds
    for (lean_model, lean_state), (whole_model, whole_state) in zip(results[True],
                                                                     results[False]):
        assert lean_model == whole_model  # the same tensors, names and order
        assert (lean_state is None) == (whole_state is None) == (server == "fedavg")
        if lean_state is not None and whole_state is not None:  # (the job names differ)
            a, b = loads(lean_state), loads(whole_state)
            assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert loads(results[True][1][0])["n"].item() == 7  # the integer buffer: 5 + 1 + 1


def _lean_inputs(store: BlobStore, name: str) -> tuple[JobSpec, Any, Any, dict[str, Any]]:
    """A FedAdam job's stored model and a stored state whose tensors are in another
    order than a lean step writes (``v`` before ``m``, the last tensor first)."""
    spec = parse_spec({**SPEC, "eval_every": 0, "server": {"name": "fedadam"}})
    model = store.put_parts(f"jobs/{name}/r00001/global", dump_parts(MODEL))
    floats = [n for n, v in MODEL.items() if v.is_floating_point()]
    g = torch.Generator().manual_seed(3)
    state = {f"{k}.{n}": torch.rand(MODEL[n].shape, generator=g)
             for n in reversed(floats) for k in ("v", "m")}
    return spec, model, store.put_parts(f"jobs/{name}/r00001/server-state",
                                        dump_parts(state)), state


def test_a_lean_step_reads_a_state_in_another_order_whole_and_writes_its_own(
        stores: Stores) -> None:
    """A stored state the lean step cannot stream (another order: a state written by a
    whole-model commit of another version) is read whole, with the same result as the
    whole-model step; the new state is written in the lean step's order, which the next
    lean step streams."""
    from fedq.coordinator import lean

    store = stores.streamed
    spec, model, ref, state = _lean_inputs(store, "order")
    delta = {k: v.float() for k, v in _model_delta(5).items()}
    want = pipeline.server_update(spec, MODEL, delta, state)
    got, new = lean.server_step(spec, store, model, {k: v.clone() for k, v in delta.items()},
                                ref, "jobs/order/r00002/server-state", {"job": "order"})
    assert all(torch.equal(got.weights[k], want.weights[k]) for k in MODEL)
    assert new is not None and got.state == {}
    written = loads(store.get(new))
    assert sorted(written) == sorted(want.state)
    assert all(torch.equal(written[k], want.state[k]) for k in written)
    floats = [n for n, v in MODEL.items() if v.is_floating_point()]
    assert list(written) == [f"{k}.{n}" for n in floats for k in ("m", "v")]


def test_a_lean_step_over_a_corrupted_stored_state_writes_no_new_state(
        stores: Stores) -> None:
    """The stored state's digest is checked after its last piece, before the new
    state's last part is written: a mismatch fails the step and leaves no new state."""
    import fedq.digest as digests
    from fedq.blobs import BlobRef
    from fedq.coordinator import lean
    from fedq.errors import BlobIntegrityError, BlobNotFound

    store = stores.streamed
    spec, model, _, _ = _lean_inputs(store, "bad")
    delta = {k: v.float() for k, v in _model_delta(5).items()}
    first, ref = lean.server_step(spec, store, model, dict(delta), None,
                                  "jobs/bad/r00002/server-state", {"job": "bad"})
    assert ref is not None  # a first step's state, in the lean step's order
    wrong = BlobRef(ref.key, digests.of(b"another state"), ref.size)
    with pytest.raises(BlobIntegrityError):
        lean.server_step(spec, store, model, dict(delta), wrong,
                         "jobs/bad/r00003/server-state", {"job": "bad"})
    with pytest.raises(BlobNotFound):
        store.get(BlobRef("jobs/bad/r00003/server-state", ref.sha256, ref.size))


# The worker's side: an update written as its tensors are made, one model kept.

def test_a_streamed_file_is_the_file_and_lazy_tensors_are_made_one_at_a_time() -> None:
    from fedq.weights import LazyWeights, dump_stream

    meta = {"fedq.codec": "none", "job": "j"}
    size, parts = dump_stream(MODEL, meta)
    assert b"".join(bytes(p) for p in parts) == dumps(MODEL, meta) == dumps(MODEL, meta)
    assert size == len(dumps(MODEL, meta))
    made: list[str] = []

    def make(name: str) -> torch.Tensor:
        made.append(name)
        return MODEL[name].clone()

    lazy = LazyWeights({k: torch.empty(v.shape, dtype=v.dtype, device="meta")
                        for k, v in MODEL.items()}, make)
    size, parts = dump_stream(lazy, meta)
    assert made == []  # the header needs the outline alone
    out = b""
    for i, part in enumerate(parts):  # the length, the header, then a tensor a part
        out += bytes(part)
        assert len(made) == max(0, i - 1)
    assert out == dumps(MODEL, meta) and made == list(MODEL)


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_an_encoded_update_is_streamed_as_encode_writes_it_one_tensor_at_a_time(
        codec: str) -> None:
    """A worker's fp16 or int8 update is written as each tensor is encoded: the same
    file as encoding the whole update, each tensor of a lazy delta made once, when
    its encoded tensors are written."""
    from fedq.weights import LazyWeights

    delta = _model_delta(4)
    meta = {**meta_of(codec, 256), "job": "j"}
    stored, said = encode(delta, codec, 256)
    whole = dumps(stored, {**said, "job": "j"})
    made: list[str] = []

    def make(name: str) -> torch.Tensor:
        made.append(name)
        return delta[name].clone()

    lazy = LazyWeights({k: torch.empty(v.shape, dtype=v.dtype, device="meta")
                        for k, v in delta.items()}, make)
    size, parts = dump_stream(encoded_lazily(lazy, codec, 256), meta)
    assert made == []
    out = b""
    for part in parts:
        out += bytes(part)
    assert out == whole and size == len(whole)
    assert made == list(delta)  # each once, in order (int8: its values, then its scales)


def test_a_stream_is_stored_in_chunks_as_it_comes(redis_db: str) -> None:
    from fedq.errors import BlobError
    from fedq.weights import LazyWeights, dump_stream

    store = open_store(redis_db, chunk_bytes=CHUNK)
    pulled: list[int] = []
    stored: list[int] = []

    def make(name: str) -> torch.Tensor:
        pulled.append(len(stored))  # chunks stored before this tensor was made
        return MODEL[name]

    lazy = LazyWeights(MODEL, make)
    size, parts = dump_stream(lazy)
    ref = store.put_stream("jobs/j/r00001/updates/c000001", size, parts, stored.append)
    assert bytes(store.get(ref)) == dumps(MODEL)
    assert ref.size == size > CHUNK and len(stored) == -(-size // CHUNK)
    assert pulled[-1] > 0  # the last tensor was made after chunks were already stored
    size, parts = dump_stream(MODEL)
    with pytest.raises(BlobError, match="bytes written, .* announced"):
        store.put_stream("jobs/j/r00001/updates/c000002", size + 1, parts)


def test_a_worker_keeps_one_big_model_and_lets_the_last_go_first(
        stores: Stores, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedq.process import PROCESS
    from fedq.settings import get_settings
    from fedq.worker.update import fetch_global

    monkeypatch.setenv("FEDQ_HOME", str(tmp_path))
    monkeypatch.delenv("FEDQ_BLOB_CACHE", raising=False)
    get_settings.cache_clear()
    PROCESS.clear()
    store = stores.streamed
    small = store.put("jobs/j/r00000/global", dumps({"x": torch.ones(3)}))
    first = store.put_parts("jobs/j/r00001/global", dump_parts(MODEL))
    second = store.put_parts("jobs/j/r00002/global",
                             dump_parts({k: v + 1 for k, v in MODEL.items()}))
    try:
        fetch_global(store, small)
        fetch_global(store, first)
        assert list(PROCESS.models) == [first.sha256]  # a big model: the only one kept
        weights, _ = fetch_global(store, second)
        assert list(PROCESS.models) == [second.sha256]
        assert torch.equal(weights["w"], MODEL["w"] + 1)
        assert stores.read == [small.key]  # the big ones were read piece by piece
    finally:
        PROCESS.clear()
        get_settings.cache_clear()


def test_a_stream_is_written_as_it_comes_on_every_store(stores: Stores) -> None:
    """put_stream never gathers the parts: Redis stores chunks, a local folder writes a
    temporary file and renames it, S3 sends a multipart upload part by part (12 MB in
    parts of S3's least, 5 MiB: three)."""
    store = stores.streamed
    if isinstance(store, S3BlobStore):
        store.part_bytes = 5 << 20
    block = bytes(range(256)) * 4096  # 1 MiB
    made: list[int] = []

    def parts() -> Any:
        for i in range(12):
            made.append(i)
            yield block

    ref = store.put_stream("jobs/j/r00001/updates/c000009", 12 << 20, parts())
    assert made == list(range(12)) and ref.size == 12 << 20
    assert bytes(stores.whole.get(ref)) == block * 12
    if isinstance(store, S3BlobStore):
        head = store._client.head_object(Bucket=store.bucket,
                                         Key=store.prefix + ref.key)
        assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # three parts
    if stores.kind == "local":
        assert not [p for p in Path(store.url).rglob(".tmp-*")]
