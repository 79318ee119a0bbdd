"""A plugin's own modules travel with it: its folder is importable where it is loaded, a helper beside it goes by
value inside what the actors receive, and a module the receiving side lacks is one line naming it when the
value is opened (:class:`rayfl.plugins.Sealed`), never an error while the actor's arguments are read.

Each case runs in a fresh interpreter (what is registered and imported stays there): one process loads and
seals, a second one, without the plugin's folder or the helper on its path, opens."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PLUGIN = textwrap.dedent('''
    import numpy as np
    import {helper}

    from rayfl import DatasetSource


    def blobs():
        rng = np.random.default_rng(0)
        y = rng.integers(0, 3, 30)
        return rng.normal(size=(30, 4)).astype("float32") * {helper}.SCALE + y[:, None], y


    DATASET = DatasetSource("blobs-travel", blobs)
''')

SEAL = textwrap.dedent('''
    import sys
    from ray import cloudpickle
    from rayfl.plugins import Sealed, carried, load_plugin
    load_plugin(sys.argv[1])
    sys.stdout.buffer.write(cloudpickle.dumps(Sealed(carried())))
''')

OPEN = textwrap.dedent('''
    import sys
    from ray import cloudpickle
    from rayfl.config import UserError
    sealed = cloudpickle.loads(sys.stdin.buffer.read())
    try:
        plugins = sealed.open()
    except UserError as e:
        print("UserError:", e)
    else:
        from rayfl.data.datasets import registered
        x, y = registered()["blobs-travel"].load()
        print("loaded", float(abs(x).max()) > 50)
''')


def _seal_and_open(tmp_path, helper: str, helper_dir) -> str:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (home / "plug.py").write_text(PLUGIN.format(helper=helper))
    (helper_dir / f"{helper}.py").write_text("SCALE = 100.0\n")
    env_path = str(helper_dir) if helper_dir != home else ""
    sealed = subprocess.run([sys.executable, "-c", SEAL, str(home / "plug.py")], capture_output=True, cwd=tmp_path,
                            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, check=True).stdout
    opened = subprocess.run([sys.executable, "-c", OPEN], input=sealed, capture_output=True, cwd="/",
                            env={"PATH": "/usr/bin:/bin"})
    assert opened.returncode == 0, opened.stderr.decode()[-3000:]
    return opened.stdout.decode().strip()


def test_a_helper_beside_the_plugin_loads_and_travels_by_value(tmp_path):
    assert _seal_and_open(tmp_path, "travel_helpers", tmp_path / "home") == "loaded True"


def test_a_helper_from_elsewhere_missing_on_the_other_side_is_one_line_naming_it(tmp_path):
    far = tmp_path / "far"
    far.mkdir()
    out = _seal_and_open(tmp_path, "far_travel_helper", far)
    assert out.startswith("UserError: plugin=[") and "module 'far_travel_helper' is not importable on node" in out
    assert "\n" not in out
