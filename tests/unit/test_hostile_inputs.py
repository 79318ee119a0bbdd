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
from rayfl.checkpoint import FILE as CHECKPOINT_FILE
from rayfl.loop import Loop
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
    "history_record_odd": (lambda s: s["history"].append({"odd": "record"}),
                           "history[4].step=None: must be a round index after the one before"),
    "history_step_backwards": (lambda s: s["history"].__setitem__(1, {**s["history"][1], "step": 0}),
                               "history[1].step=0: must be a round index after the one before"),
    "history_stage_unknown": (lambda s: s["history"].__setitem__(0, {**s["history"][0], "stage": "x"}),
                              "history[0].stage=x: not one of this run's stages"),
    "history_metric_text": (lambda s: s["history"][0].__setitem__("test_acc_mean", "high"),
                            "history[0]['test_acc_mean']: must be a metric name with a number"),
    "dp_history_garbage": (_set("dp_history", [["x"]]), "dp_history: every entry must be a list of numbers"),
    "upload_ids_client_99": (_server("upload_ids", [0, 99]),
                             "server.upload_ids=[0, 99]: must be a list of this run's client ids (0 to 2)"),
    "p_minus_1e300": (_server("P", np.full((3, 3), -1e300)), "server.P: holds values beyond 1e+12 in magnitude"),
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


# --------------------------------------------------------------------------------------------------
# The battery (tests/hostile_battery.py, also its generator): directories handed over, hangs, memory,
# tracebacks, silent accepts and raw exceptions, each one line with its exit status, nothing left behind
# --------------------------------------------------------------------------------------------------
import hostile_battery as battery  # noqa: E402 - the table lives beside its generator


@pytest.fixture(scope="module")
def battery_dir(tmp_path_factory) -> str:
    t = str(tmp_path_factory.mktemp("battery"))
    battery.build(t)  # once: every case is refused before it writes anything another case reads
    return t


@pytest.fixture
def registries():
    """What a case's plugins register in this process (algorithms, datasets, loaded sources) forgotten after it."""
    from rayfl import algorithms, plugins
    from rayfl.data import datasets

    kept = [(d, dict(d)) for d in (algorithms._registered, algorithms._sources, plugins._loaded,
                                   datasets._REGISTRY, datasets._LAST)]
    yield
    for d, before in kept:
        d.clear()
        d.update(before)


@pytest.mark.parametrize("case", battery.CASES, ids=[c.id for c in battery.CASES])
def test_battery(case, battery_dir, registries, monkeypatch, capsys, ray_inits):
    t = battery_dir
    monkeypatch.chdir(t)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAYFL_PLUGINS", raising=False)
    for key, value in case.env.items():
        monkeypatch.setenv(key, battery.expand(value, t))
    if case.available is not None:  # the memory the budget sees: a small input stands for a large one
        import psutil

        real = psutil.virtual_memory
        monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=case.available))
    t0 = time.monotonic()
    if case.api is not None:
        import rayfl

        with pytest.raises(rayfl.UserError) as e:
            exec(case.api, {"rayfl": rayfl})  # noqa: S102 - the case's own API call, written above
        code, err = 2, f"rayfl: error: {e.value}\n"
    else:
        code = main(battery.expand(case.argv, t))
        err = capsys.readouterr().err
    assert code == case.code, err
    assert err.startswith("rayfl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert battery.expand(case.fragment, t) in err, err
    assert "s3cret" not in err
    for path in case.absent:
        assert not os.path.exists(battery.expand(path, t)), path
    assert time.monotonic() - t0 < case.timeout
    assert not ray_inits


def test_the_battery_covers_every_category():
    ids = [c.id for c in battery.CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 90
    assert {c.category for c in battery.CASES} == {"directories", "hangs", "memory", "tracebacks", "raw exceptions",
                                                   "silent accepts", "credentials"}


# --------------------------------------------------------------------------------------------------
# tracking servers that never answer, or answer 500: refused within seconds, by run and by sync
# --------------------------------------------------------------------------------------------------
HTTP_500 = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@pytest.mark.parametrize("reply, why", [
    (None, "accepted a connection but sent no answer in 5 s"),
    (HTTP_500, "answered its health check with HTTP 500 (a server error)"),
], ids=["silent", "http500"])
@pytest.mark.parametrize("command", ["run", "sync"])
def test_a_tracking_server_that_does_not_serve_is_one_line_within_10_s(command, reply, why, tmp_path, monkeypatch,
                                                                       capsys, ray_inits):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    server = Listener(reply)
    uri = f"http://alice:s3cret@127.0.0.1:{server.port}"
    box = tmp_path / "r" / "mlflow_outbox"
    box.mkdir(parents=True)
    (box / "run.json").write_text(json.dumps({"run_id": battery.RUN_ID, "tracking_uri": uri, "status": None}))
    argv = (["run", *battery.TINY, "--tracking-uri", uri] if command == "run" else ["sync", str(tmp_path / "r")])
    main(argv[:-1] + ["http://127.0.0.1:1"] if command == "run" else ["sync", str(tmp_path / "none")])
    capsys.readouterr()  # the command's imports done (seconds on a busy machine): what is timed is the wait
    try:
        t0 = time.monotonic()
        code = main(argv)
        took = time.monotonic() - t0
    finally:
        server.close()
    assert code == 2
    err = one_line(capsys)
    assert f"the server at 127.0.0.1:{server.port} {why}" in err and "s3cret" not in err, err
    assert took < 10, took
    assert not ray_inits


def test_the_health_check_lets_an_answering_server_through():
    from rayfl.tracking.store import tracking_server_problem

    server = Listener(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    try:
        assert tracking_server_problem(f"http://127.0.0.1:{server.port}/prefix") is None
    finally:
        server.close()


# --------------------------------------------------------------------------------------------------
# what a sync sends: the outbox's own regular files, to the run's existing store
# --------------------------------------------------------------------------------------------------
def test_sync_delivers_an_outbox_and_refuses_one_with_a_link_out(tmp_path, capsys):
    """The same outbox is delivered once its link out is removed: the refusal is the link, not the outbox."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    box = tmp_path / "r" / "mlflow_outbox"
    (box / "files" / "000000" / "results").mkdir(parents=True)
    (box / "files" / "000000" / "results" / "own.txt").write_text("the run's own file\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    os.symlink(tmp_path / "secret.txt", box / "files" / "000000" / "results" / "secret.txt")
    (box / "run.json").write_text(json.dumps({"run_id": run_id, "tracking_uri": uri, "experiment_id": "1",
                                              "status": "FINISHED", "end_time": 5}))
    (box / "metrics.jsonl").write_text('{"key": "acc", "value": 0.5, "timestamp": 1, "step": 0}\n'
                                       '{"key": "acc", "value": "NaN", "timestamp": 2, "step": 1}\n{"key": "ac')
    capsys.readouterr()  # MLflow's own lines from creating the test's store
    assert main(["sync", str(tmp_path / "r")]) == 2
    assert "secret.txt: a link or a special file" in one_line(capsys)
    assert client.get_metric_history(run_id, "acc") == [] and not client.list_artifacts(run_id)

    os.unlink(box / "files" / "000000" / "results" / "secret.txt")
    assert main(["sync", str(tmp_path / "r")]) == 0
    assert "rayfl sync: 2 metric points, 0 params, 0 tags, 1 artifact trees, status FINISHED" in capsys.readouterr().out
    history = client.get_metric_history(run_id, "acc")
    assert [m.value for m in history][0] == 0.5 and math.isnan(history[1].value)  # the cut last line skipped
    assert [a.path for a in client.list_artifacts(run_id, "results")] == ["results/own.txt"]
    assert client.get_run(run_id).info.status == "FINISHED"


# --------------------------------------------------------------------------------------------------
# a plugin that takes long to import is announced; a trial key with a NUL byte is refused
# --------------------------------------------------------------------------------------------------
def test_a_slow_plugin_import_is_announced(tmp_path, monkeypatch, capsys):
    from rayfl import plugins

    monkeypatch.setattr(plugins, "SLOW_IMPORT_S", 0.2)
    path = tmp_path / "slow.py"
    path.write_text("import time\ntime.sleep(1.0)\n")
    assert main(["algos", "--plugin", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"rayfl: importing plugin='{path}' is taking more than 0.2 s ..."
    assert lines[1].startswith(f"rayfl: error: plugin='{path}': defines none of ALGORITHM") and len(lines) == 2


def test_a_trial_key_with_a_nul_byte_is_refused(tmp_path):
    from rayfl.sweep.records import TRIALS_FILE, read_records

    (tmp_path / TRIALS_FILE).write_text(json.dumps({"trials": {"abc\u0000": {"config": {"lr": 0.1}}}}))
    with pytest.raises(UserError, match=r"trials\.'abc\\x00': not a trial record \(a key of letters"):
        read_records(str(tmp_path), ["lr"])


def test_reading_an_idx_file_costs_what_its_budget_says(tmp_path):
    """The budget an IDX header is checked against is what reading it takes at its peak, measured (within 20%):
    a .gz of 5,000 images read as --dataset mnist reads them (their standardization in one chunk)."""
    import gzip
    import tracemalloc

    from rayfl.data import datasets

    n = 5000
    header = bytes([0, 0, 8, 3]) + struct.pack(">III", n, 28, 28)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(header + os.urandom(n * 784), 1))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", n) + bytes(n))
    cfg = make_config(None, {"dataset": "mnist", "data_root": str(tmp_path)})
    tracemalloc.start()
    try:
        ds = datasets._mnist_like("mnist", cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ds.x.shape == (n, 1, 28, 28)
    assert 0.8 * datasets.idx_budget([n, 28, 28]) < peak <= datasets.idx_budget([n, 28, 28]), (
        peak, datasets.idx_budget([n, 28, 28]))
