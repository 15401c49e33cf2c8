"""cluster.jobs / cluster.train_entry: a short training submitted with `ray job submit` to a
local head node completes. The head runs in its own process group, which the test ends (not
`ray stop --force`, which would stop every Ray on a shared machine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")

from cluster.jobs import submit_argv  # noqa: E402

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_submit_argv():
    argv = submit_argv("http://h:8265", ["--toy"], working_dir="wd",
                       runtime_env={"env_vars": {"A": "1"}})
    assert argv[1:8] == ["job", "submit", "--address", "http://h:8265", "--working-dir", "wd",
                         "--runtime-env-json"]
    assert argv[-4:] == ["python", "-m", "cluster.train_entry", "--toy"]
    with pytest.raises(ValueError):
        submit_argv("h:8265", [])


def test_ray_job_submit_local_head(tmp_path):
    ray_exe = str(Path(sys.executable).with_name("ray"))
    port, dash = _free_port(), _free_port()
    # Its own temp dir, so its address file does not redirect other sessions' ray.init().
    temp_dir = tempfile.mkdtemp(prefix="vray", dir="/tmp")
    head = subprocess.Popen(
        [ray_exe, "start", "--head", "--block", "--num-cpus", "2", "--disable-usage-stats",
         "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--dashboard-port",
         str(dash), "--port", str(port), "--temp-dir", temp_dir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 60
        while True:  # wait for the job server
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{dash}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:  # e.g. 401: token authentication is on; it is up
                break
            except OSError:
                if time.time() > deadline or head.poll() is not None:
                    pytest.fail("the Ray head did not come up")
                time.sleep(1)
        wd = tmp_path / "job"
        wd.mkdir()
        (wd / "entry.py").write_text(
            "import sys\nfrom cluster.train_entry import main\nsys.exit(main(sys.argv[1:]))\n")
        argv = submit_argv(f"http://127.0.0.1:{dash}", [
            "--toy", "--max_steps", "3", "--num_workers", "1", "--cpus_per_worker", "0.5",
            "--run_name", "job-test", "--storage_path", str(tmp_path / "runs")],
            working_dir=wd)
        argv[argv.index("-m"):argv.index("cluster.train_entry") + 1] = ["entry.py"]
        # The head runs with token authentication (Ray's default for local clusters); the
        # client sends the token (~/.ray/auth_token) when told the mode.
        env = dict(os.environ, RAY_AUTH_MODE="token")
        for _ in range(12):
            out = subprocess.run(argv, capture_output=True, text=True, timeout=150, env=env)
            text = out.stdout + out.stderr
            # the job server answers before the head's job agent has registered (a loaded
            # machine): Ray's own "try again later", which nothing has run yet
            if out.returncode == 0 or "No available agent to submit job" not in text:
                break
            time.sleep(5)
        assert out.returncode == 0, text[-3000:]
        assert "VOODOO_TRAIN_RESULT" in text and '"finished": true' in text, text[-3000:]
        assert (tmp_path / "runs" / "job-test").is_dir()
        # a driver joining that cluster by RAY_ADDRESS without the token: Ray retries for about
        # 20 s and says "Failed to connect"; Voodoo's error names the token (a new user's case)
        env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
        env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
        out = subprocess.run([sys.executable, "-c", "from cluster.session import ensure_ray\n"
                              "try:\n    ensure_ray()\nexcept ConnectionError as e:\n"
                              "    print('ERR', e)"], capture_output=True, text=True,
                             timeout=180, env=env, cwd=str(Path(__file__).parents[2]))
        assert "ERR " in out.stdout and "set RAY_AUTH_MODE=token" in out.stdout, \
            (out.stdout + out.stderr)[-3000:]
        # more Ray Train workers than that cluster holds: refused once joined, before the model
        # is even looked at (it was refused after the data, imatrix and candidates)
        env["RAY_AUTH_MODE"] = "token"
        out = subprocess.run([sys.executable, "-m", "voodoo.cli", "train", "--ray",
                              "--num_workers", "3", "--model", str(tmp_path / "no-model"),
                              "--output_dir", str(tmp_path / "o")], capture_output=True,
                             text=True, timeout=180, env=env, cwd=str(Path(__file__).parents[2]))
        err = out.stderr.strip().splitlines()
        assert out.returncode == 2 and "3 Ray Train workers need CPU 1 each" in err[-1], \
            out.stderr[-3000:]
        assert "no-model" not in out.stderr and not (tmp_path / "o").exists()
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)
            head.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(head.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_default_run_name_follows_the_settings():
    """Without --run_name every `python -m cluster.train_entry` run shared
    ~/ray_results/voodoo-train, and a second run with another ratio was refused at resume under
    a name the user never chose. The default name now hashes the factory and the settings a
    resume must match: the same command resumes, other settings get their own folder."""
    from cluster.train_entry import build_parser, default_run_name
    from voodoo.train import TrainConfig

    def name(argv, **cfg):
        return default_run_name(build_parser().parse_args(argv), TrainConfig(**cfg))
    a = name(["--toy"], compression_ratio=0.7, seq_len=16)
    assert a.startswith("voodoo-train-") and a == name(["--toy"], compression_ratio=0.7,
                                                       seq_len=16)
    assert a != name(["--toy"], compression_ratio=0.6, seq_len=16)
    assert a != name(["--factory", "m:f"], compression_ratio=0.7, seq_len=16)
    assert name(["--factory", "m:f", "--factory_kwargs", '{"model": "x"}']) != \
        name(["--factory", "m:f", "--factory_kwargs", '{"model": "y"}'])
