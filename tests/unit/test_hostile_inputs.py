"""Hostile inputs that need more than a line of argv (tests/unit/test_bad_inputs.py has the table): a silent or
foreign server given as the Ray address, hand-edited checkpoints, the Python API's wrong types, and the
bounds that keep every refusal one short line. None of them starts Ray."""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest

from conftest import tiny
from rayfl import snapshot
from rayfl.cli import main
from rayfl.config import MAX_MESSAGE, UserError, make_config, shown
from rayfl.experiment import prepare
from rayfl.loop import CHECKPOINT_FILE, Loop
from rayfl.runtime import LocalRuntime


def _ray_up() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


@pytest.fixture
def ray_inits(monkeypatch) -> list:
    """The calls made to ``ray.init`` during the test (none reach Ray): whether the command tried to start or
    join Ray, whatever another test left initialized in this process."""
    import ray

    calls = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: calls.append((a, k)) or (_ for _ in ()).throw(
        AssertionError("ray.init called")))
    return calls


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("rayfl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err[:500]
    return err


# --------------------------------------------------------------------------------------------------
# what an error line quotes
# --------------------------------------------------------------------------------------------------
def test_an_error_line_quotes_a_long_value_by_its_start_and_length():
    assert shown("x" * 5) == "'xxxxx'"
    assert shown("x" * 1000) == "'" + "x" * 80 + "'... (1000 characters)"
    nested: list = []
    for _ in range(3):
        nested = [nested] * 1000  # 10**9 leaves if expanded
    t0 = time.monotonic()
    assert len(shown(nested)) <= 2 * 80 + 3 and time.monotonic() - t0 < 1
    e = UserError("a" * 10**6 + "\nthe end")
    assert len(str(e)) <= MAX_MESSAGE + 40 and "\n" not in str(e) and str(e).endswith("\\nthe end")


def test_a_30_mb_experiment_name_is_one_short_line_before_anything_starts(tmp_path, monkeypatch, capsys, ray_inits):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--experiment", "e" * 30_000_000]) == 2
    err = one_line(capsys)
    assert len(err) < 200, len(err)
    assert "(30000000 characters): at most 4096 characters" in err
    assert not ray_inits


def test_a_300_byte_billion_laughs_file_is_refused_at_once(tmp_path, capsys):
    levels = ['  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    levels += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp_path / "laughs.yaml"
    path.write_text("params:\n" + "\n".join(levels) + "\n")
    assert path.stat().st_size < 700
    assert main(["run", "--config", str(path)]) == 2
    err = one_line(capsys)
    assert len(err) < 300 and "more than 10,000 values" in err
    t0 = time.monotonic()  # the refusal itself, without the command's imports
    with pytest.raises(UserError, match="more than 10,000 values"):
        make_config(str(path))
    assert time.monotonic() - t0 < 1


def test_aliases_within_the_bound_still_load(tmp_path):
    """Anchors are YAML: a small one, used twice, is a config like any other."""
    path = tmp_path / "c.yaml"
    path.write_text("dataset: synthetic\nparams: &knobs {}\nexperiment: &e exp\nrun_name: *e\n")
    cfg = make_config(str(path))
    assert cfg.experiment == cfg.run_name == "exp"


# --------------------------------------------------------------------------------------------------
# the Python API: wrong types are one-line UserErrors, never coerced
# --------------------------------------------------------------------------------------------------
def _api_cases():
    import rayfl

    return {
        "run_resume_int": (lambda: rayfl.run(resume=123, progress=False), "resume=123: must be a run directory"),
        "run_address_int": (lambda: rayfl.run(address=123, progress=False, **TINY),
                            "address=123: must be a string"),
        "run_name_nul": (lambda: rayfl.run(run_name="a\0b", progress=False, **TINY),
                         "run_name='a\\x00b': must not contain a NUL byte"),
        "out_dir_nul": (lambda: rayfl.run(out_dir="a\0b", progress=False, **TINY),
                        "out_dir='a\\x00b': must not contain a NUL byte"),
        "params_deep": (lambda: rayfl.run(params={"x": _deep(5000)}, progress=False, **TINY),
                        "params: nested more than 32 levels deep"),
        "params_cyclic": (lambda: rayfl.run(params={"x": _cyclic()}, progress=False, **TINY),
                          "params: nested more than 32 levels deep"),
        "compare_seeds_text": (lambda: rayfl.compare(["fedavg"], seeds="abc", runtime="local", **TINY),
                               "seeds='abc': give one or more distinct integer seeds"),
        "compare_seeds_fraction": (lambda: rayfl.compare(["fedavg"], seeds=[1.5], runtime="local", **TINY),
                                   "seeds=[1.5]: give one or more distinct integer seeds"),
        "compare_max_concurrent_text": (lambda: rayfl.compare(["fedavg"], seeds=[0], max_concurrent="x", **TINY),
                                        "max_concurrent='x': must be an integer >= 1"),
        "compare_max_concurrent_fraction": (lambda: rayfl.compare(["fedavg"], seeds=[0], max_concurrent=1.5, **TINY),
                                            "max_concurrent=1.5: must be an integer >= 1"),
        "compare_name_nul": (lambda: rayfl.compare(["fedavg"], seeds=[0], name="a\0b", runtime="local", **TINY),
                             "name='a\\x00b': must not contain a NUL byte"),
        "compare_name_int": (lambda: rayfl.compare(["fedavg"], seeds=[0], name=5, runtime="local", **TINY),
                             "name=5: must be a string"),
        "compare_params_deep": (lambda: rayfl.compare(["fedavg"], seeds=[0], params={"x": _deep(5000)},
                                                      runtime="local", **TINY), "params: nested more than 32"),
        "tune_name_nul": (lambda: rayfl.tune(name="a\0b", progress=False, **TINY),
                          "name='a\\x00b': must not contain a NUL byte"),
        "tune_space_deep": (lambda: rayfl.tune(space={"grid": {"lr": _deep(5000)}}, progress=False, **TINY),
                            "space: nested more than 32 levels deep"),
    }


TINY = {"dataset": "synthetic", "partition": "iid", "clients": 2, "rounds": 1, "samples_per_client": 40}


def _deep(n: int) -> list:
    out: list = []
    for _ in range(n):
        out = [out]
    return out


def _cyclic() -> list:
    out: list = []
    out.append(out)
    return out


@pytest.mark.parametrize("case", sorted(_api_cases()))
def test_api_refuses_in_one_line(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    call, fragment = _api_cases()[case]
    was_up = _ray_up()
    with pytest.raises(UserError) as e:
        call()
    assert fragment in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)
    assert _ray_up() == was_up


# --------------------------------------------------------------------------------------------------
# --address: a port that is open but is not Ray
# --------------------------------------------------------------------------------------------------
class Listener:
    """A plain TCP server on a free loopback port: silent (accepts, reads, says nothing) or answering every
    connection with ``reply`` (an HTTP server, or an HTTP/2 SETTINGS frame as gRPC's)."""

    def __init__(self, reply: bytes | None = None):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.05)  # accept() wakes up to see ``stop``
        self.port = self.sock.getsockname()[1]
        self.reply, self.conns, self.stop = reply, [], False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.conns.append(conn)
            if self.reply is not None:
                try:
                    conn.settimeout(5)
                    if conn.recv(1024):  # a probe that only connects sends nothing and closes
                        conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self):
        self.stop = True
        self.thread.join(timeout=5)
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("reply, why", [
    (None, "something listens there but sent nothing in 3 s; a Ray cluster speaks gRPC"),
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
     "something listens there but does not speak gRPC, as a Ray cluster does"),
], ids=["silent", "http"])
def test_an_open_port_that_is_not_ray_is_one_line_within_10_s(reply, why, tmp_path, monkeypatch, capsys,
                                                              ray_inits):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    server = Listener(reply)
    try:
        t0 = time.monotonic()
        code = main(["run", *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()],
                     "--address", f"127.0.0.1:{server.port}"])
        took = time.monotonic() - t0
    finally:
        server.close()
    assert code == 2
    err = one_line(capsys)
    assert f"address='127.0.0.1:{server.port}': no Ray cluster answers there ({why})" in err, err
    assert took < 10, took
    assert not ray_inits


def test_the_grpc_probe_lets_an_http2_server_through():
    """What a gRPC server (Ray's GCS among them) sends first: a SETTINGS frame on stream 0 (RFC 9113, 6.5)."""
    from rayfl.session import not_grpc

    settings = struct.pack(">I", 6)[1:] + bytes([4, 0]) + bytes(4) + struct.pack(">HI", 3, 100)
    server = Listener(settings)
    try:
        assert not_grpc("127.0.0.1", server.port) is None
    finally:
        server.close()


# --------------------------------------------------------------------------------------------------
# hand-edited checkpoints: one line naming the file and the field, before Ray starts
# --------------------------------------------------------------------------------------------------
def _run_dir(tmp_path) -> tuple[str, dict]:
    """A fedfomo run directory (3 clients, a checkpoint after round 2 of 3), as ``rayfl run`` leaves one."""
    from rayfl.session import make_run_dir

    cfg = tiny(algo="fedfomo", rounds=3, checkpoint_every=1, params={"M": 2}, out_dir=str(tmp_path / "runs"),
               tracking_uri=f"sqlite:///{tmp_path}/m.db")
    run_dir = make_run_dir(cfg, "r", cfg.tracking_uri)
    p = prepare(cfg)
    Loop(p, LocalRuntime(p), checkpoint_dir=run_dir).run()
    return run_dir, snapshot.load(os.path.join(run_dir, CHECKPOINT_FILE))


def _client(state: dict, cid: int, edit) -> None:
    tree = snapshot.loads(state["clients"][cid])
    edit(tree)
    state["clients"][cid] = snapshot.dumps(tree)


def _edited_header(data: bytes, edit) -> bytes:
    """Snapshot bytes with their JSON header rewritten and their array bytes kept (a hand edit of the header)."""
    pos = len(snapshot.MAGIC) + 8
    (n,) = struct.unpack("<Q", data[len(snapshot.MAGIC):pos])
    header = edit(json.loads(data[pos:pos + n]))
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return snapshot.MAGIC + struct.pack("<Q", len(raw)) + raw + data[pos + n:]


def _header_edit(path: str, edit) -> None:
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(_edited_header(data, edit))


def _untag_gen(state):
    def edit(header):
        del header["tree"]["v"]["gen"]["t"]  # the torch Generator state's dtype tag
        return header
    state["clients"][0] = _edited_header(state["clients"][0], edit)


def _set(key, value):
    def edit(state):
        state[key] = value
    return edit


def _server(key, value):
    def edit(state):
        if value is KeyError:
            del state["server"][key]
        else:
            state["server"][key] = value
    return edit


def _nan_weights(state):
    _client(state, 1, lambda t: t["model"].__setitem__(slice(0, 3), np.nan))


def _drop_client(state):
    del state["clients"][2]


def _extra_client(state):
    state["clients"][7] = state["clients"][0]


def _client_missing_key(state):
    _client(state, 0, lambda t: t.pop("gen"))


def _client_bad_shape(state):
    _client(state, 2, lambda t: t.__setitem__("model", t["model"][:-1]))


def _nan_p(state):
    state["server"]["P"][0, 1] = np.nan


def _bad_rng(state):
    state["rng"] = {"bit_generator": "PCG64", "state": "not a state"}


STATE_EDITS = {  # edit of the loaded checkpoint -> fragment after "checkpoint=<path>: "
    "client_weights_nan": (_nan_weights, "clients[1].model: holds NaN or infinite values"),
    "p_wrong_shape": (_server("P", np.eye(2)), "server.P: shape (2, 2) of float64, expected (3, 3) of float64"),
    "p_7x7_for_3_clients": (_server("P", np.eye(7)), "server.P: shape (7, 7) of float64, expected (3, 3)"),
    "p_nan": (_nan_p, "server.P: holds NaN or infinite values"),
    "p_a_list": (_server("P", [[1.0]]), "server.P: a list, expected a ndarray"),
    "server_key_missing": (_server("W", KeyError), "server: no 'W'"),
    # 3 training rounds and FedFomo's update-only round (final_update): 4 in all
    "step_negative": (_set("step", -4), "step=-4: must be a round index in [0, 3] (this run has 4 rounds)"),
    "step_beyond": (_set("step", 99), "step=99: must be a round index in [0, 3]"),
    "step_text": (_set("step", "1"), "step=1: must be a round index"),
    "client_missing": (_drop_client, "clients: no client 2 of this run's 3 (0 to 2)"),
    "client_extra": (_extra_client, "clients: client 7 is not one of this run's 3 (0 to 2)"),
    "client_key_missing": (_client_missing_key, "clients[0]: no 'gen'"),
    "client_weights_short": (_client_bad_shape, "clients[2].model: shape"),
    "client_tensor_tag_missing": (_untag_gen, "unreadable (clients[0]: malformed snapshot at .gen: KeyError: 't')"),
    "rng_garbage": (_bad_rng, "rng: not a random generator's state"),
    "history_not_list": (_set("history", {"a": 1}), "history: a dict, expected a list"),
}


def _deep_tree(header):
    header["tree"] = "DEEP"
    return json.dumps(header).encode().replace(b'"DEEP"', b"[" * 100_000 + b"]" * 100_000)


HEADER_EDITS = {  # edit of the file's JSON header -> fragment
    "shape_unparsable": (lambda h: {**h, "arrays": [{**h["arrays"][0], "s": ["x", 3]}, *h["arrays"][1:]]},
                         "unreadable (array 0: shape ['x', 3] is not a list of at most 32 integers >= 0)"),
    "shape_1_tb": (lambda h: {**h, "arrays": [{**h["arrays"][0], "s": [2**40]}, *h["arrays"][1:]]},
                   "truncated snapshot data: array 0 declares shape (1099511627776,)"),
    "shape_overflowing_int64": (lambda h: {**h, "arrays": [{**h["arrays"][0], "s": [2**32, 2**32, 2**32]}, *h["arrays"][1:]]},
                                "truncated snapshot data: array 0 declares shape (4294967296, 4294967296, 4294967296)"),
    "shape_negative": (lambda h: {**h, "arrays": [{**h["arrays"][0], "s": [-1]}, *h["arrays"][1:]]},
                       "array 0: shape [-1] is not a list"),
    "json_nested_past_recursion_limit": (_deep_tree, "nested past Python's recursion limit"),
    "arrays_not_a_list": (lambda h: {**h, "arrays": 5}, "unreadable snapshot header"),
}


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    return _run_dir(tmp_path_factory.mktemp("ckpt"))


def _fresh_copy(checkpointed, tmp_path) -> str:
    import shutil

    run_dir = str(tmp_path / "run")
    shutil.copytree(checkpointed[0], run_dir)
    return run_dir


def _refused(run_dir: str, fragment: str, capsys) -> None:
    was_up = _ray_up()
    assert main(["run", "--resume", run_dir]) == 2
    err = one_line(capsys)
    assert f"checkpoint={os.path.join(run_dir, CHECKPOINT_FILE)}: " in err and fragment in err, err
    assert len(err) < 600
    assert _ray_up() == was_up


@pytest.mark.parametrize("case", sorted(STATE_EDITS))
def test_a_hand_edited_checkpoint_is_one_line_naming_file_and_field(case, checkpointed, tmp_path, capsys):
    run_dir = _fresh_copy(checkpointed, tmp_path)
    edit, fragment = STATE_EDITS[case]
    state = snapshot.load(os.path.join(run_dir, CHECKPOINT_FILE))
    edit(state)
    snapshot.save(os.path.join(run_dir, CHECKPOINT_FILE), state)
    _refused(run_dir, fragment, capsys)


@pytest.mark.parametrize("case", sorted(HEADER_EDITS))
def test_a_checkpoint_with_an_edited_header_is_one_line(case, checkpointed, tmp_path, capsys):
    run_dir = _fresh_copy(checkpointed, tmp_path)
    edit, fragment = HEADER_EDITS[case]
    _header_edit(os.path.join(run_dir, CHECKPOINT_FILE), edit)
    _refused(run_dir, fragment, capsys)


def test_the_unedited_checkpoint_passes(checkpointed, tmp_path):
    """The edits above are what is refused: the run directory as written resumes (checked without Ray)."""
    from rayfl.resume import check_checkpoint
    from rayfl.session import load_run_dir

    run_dir = _fresh_copy(checkpointed, tmp_path)
    check_checkpoint(run_dir, prepare(load_run_dir(run_dir)))


def test_every_algorithms_checkpoints_pass_the_check(monkeypatch, tmp_path):
    """No false refusals: every checkpoint a real run writes, of every algorithm at every round, passes the
    generic comparison with a fresh run (state that grows during a run must not look like an edit)."""
    from test_faults import ALGOS, cfg_for

    from rayfl.resume import check_checkpoint

    checked = []
    save = Loop.save_checkpoint

    def save_and_check(self, step, directory=None):
        save(self, step, directory)
        check_checkpoint(self.checkpoint_dir, self.prepared)
        checked.append((self.cfg.algo, step))

    monkeypatch.setattr(Loop, "save_checkpoint", save_and_check)
    for algo in sorted(ALGOS):
        p = prepare(cfg_for(algo, checkpoint_every=1))
        Loop(p, LocalRuntime(p), checkpoint_dir=str(tmp_path / algo)).run()
    assert {a for a, _ in checked} == set(ALGOS) and len(checked) >= 3 * len(ALGOS)
