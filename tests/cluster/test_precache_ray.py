"""cluster.precache: precache_ray gives precache_local's bytes, spreads over nodes, survives a
killed actor. Small tensors (64 x 512 float32) so each test runs in seconds on 2 cores."""

from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray_session import local_ray  # noqa: E402
from cluster.precache import PrecacheError, precache_ray  # noqa: E402
from voodoo.candidates import CandidateCache, precache_local  # noqa: E402

pytestmark = pytest.mark.ray

TYPES = ("Q4_K", "IQ4_XS", "Q8_0")


def _jobs():
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(4):
        name = f"blk.{i}.ffn_down.weight"
        w = rng.standard_normal((64, 512)).astype(np.float32)
        im = (rng.standard_normal(512) ** 2 + 0.1).astype(np.float32)
        jobs += [(name, w, t, None) for t in TYPES] + [(name, w, "IQ2_XXS", im)]
    return jobs


@pytest.fixture(scope="module")
def jobs():
    return _jobs()


@pytest.fixture(scope="module")
def reference(jobs, tmp_path_factory):
    """{(gguf_name, type): rows} from the no-Ray path."""
    cache = CandidateCache(tmp_path_factory.mktemp("ref"))
    keys = precache_local(jobs, cache, progress=False, n_threads=1)
    return keys, {nt: np.array(cache.get(k)) for nt, k in keys.items()}


def _assert_same(res, cache, reference):
    keys, rows = reference
    assert dict(res) == dict(keys)
    for nt, k in res.items():
        got = cache.get(k)
        assert got is not None, nt
        np.testing.assert_array_equal(got, rows[nt], err_msg=str(nt))


@pytest.fixture(scope="session")
def _ray_session():
    """A local 2-CPU Ray for this session, unless one is already up (then left alone)."""
    with local_ray():
        yield


@pytest.fixture
def ray_local(_ray_session, monkeypatch):
    """Ray initialized (re-started if a cluster test shut the session one down)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("VOODOO_QUANT_WORKERS", raising=False)
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, address="local")
    return ray


def test_bytes_identical_to_local(ray_local, jobs, reference, tmp_path, capsys):
    cache = CandidateCache(tmp_path)
    res = precache_ray(jobs, cache, progress=True)
    assert (res.hits, res.misses, res.stats["workers"]) == (0, len(jobs), 2)
    # the bar ends at 100% (weighted by each candidate's cost) and counts every candidate
    err = capsys.readouterr().err
    assert "100%" in err and f"{len(jobs)}/{len(jobs)}" in err
    _assert_same(res, cache, reference)
    # the files are those precache_local writes: same names
    assert {p.name for p in tmp_path.rglob("*.arrow")} == {
        CandidateCache(tmp_path).path(k).name for k in reference[0].values()}
    again = precache_ray(jobs, cache, progress=False)
    assert (again.hits, again.misses) == (len(jobs), 0)


def test_actors_write(ray_local, jobs, reference, tmp_path):
    cache = CandidateCache(tmp_path)
    res = precache_ray(jobs[:8], cache, progress=False, actors_write=True, max_workers=1)
    assert res.misses == 8 and res.stats["workers"] == 1
    keys, rows = reference
    for nt, k in res.items():
        np.testing.assert_array_equal(cache.get(k), rows[nt])


def test_killed_actor_still_completes(ray_local, jobs, reference, tmp_path):
    killed = []

    def kill_first(meta, actors):
        if not killed and len(actors) > 1:
            killed.append(actors[0])
            ray.kill(actors[0], no_restart=True)

    cache = CandidateCache(tmp_path)
    res = precache_ray(jobs, cache, progress=False, on_result=kill_first)
    assert killed and res.misses == len(jobs)
    assert res.stats["actor_deaths"] >= 1 and res.stats["retries"] >= 1
    _assert_same(res, cache, reference)


def test_task_errors_are_bounded(ray_local, jobs, tmp_path, capsys):
    """A job whose task always raises (NaN weights: libggml refuses them) is retried
    max_retries times on other actors, then reported; the other jobs are cached."""
    name, w, _, _ = jobs[0]
    bad = w.copy()
    bad[5, 5] = np.nan
    sub = [(name, w, "Q4_K", None), ("blk.9.ffn_down.weight", bad, "Q8_0", None),
           (name, w, "Q8_0", None)]
    cache = CandidateCache(tmp_path)
    with pytest.raises(PrecacheError) as ei:
        precache_ray(sub, cache, progress=True, max_retries=1)
    assert "3/3" in capsys.readouterr().err   # the job given up is counted as done
    err = ei.value
    assert list(err.failures) == [("blk.9.ffn_down.weight", "Q8_0")]
    assert "NaN" in next(iter(err.failures.values()))
    assert err.result.stats["retries"] == 1
    assert sum(1 for _ in tmp_path.rglob("*.arrow")) == 2


@pytest.fixture
def three_nodes(monkeypatch):
    """A simulated cluster: head (1 CPU) + 2 nodes (1 CPU, {"quant": 1} each). Shuts down the
    session's local Ray first (``ray_local`` restarts it for later tests)."""
    from ray.cluster_utils import Cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("VOODOO_QUANT_WORKERS", raising=False)
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                      "include_dashboard": False})
    quant_nodes = [c.add_node(num_cpus=1, resources={"quant": 1}) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    try:
        yield c, {n.node_id for n in quant_nodes}
    finally:
        ray.shutdown()
        c.shutdown()


def test_spread_over_nodes(three_nodes, jobs, reference, tmp_path):
    c, quant_nodes = three_nodes
    all_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(all_nodes) == 3 and quant_nodes < all_nodes
    # one actor per CPU: one on each node
    cache = CandidateCache(tmp_path / "all")
    res = precache_ray(jobs, cache, progress=False)
    assert res.stats["workers"] == 3
    assert set(res.stats["nodes"]) == all_nodes, res.stats["nodes"]
    assert sum(res.stats["nodes"].values()) == len(jobs)
    _assert_same(res, cache, reference)
    # pinned to the nodes offering "quant"
    cache = CandidateCache(tmp_path / "quant")
    res = precache_ray(jobs, cache, progress=False, resources="quant")
    assert res.stats["workers"] == 2
    assert set(res.stats["nodes"]) == quant_nodes, res.stats["nodes"]
    _assert_same(res, cache, reference)
    with pytest.raises(ValueError, match="gpu_node"):
        precache_ray(jobs, CandidateCache(tmp_path / "x"), progress=False,
                     resources="gpu_node")


def test_quant_workers_env_is_checked(ray_local, monkeypatch):
    """VOODOO_QUANT_WORKERS=abc gave int()'s 'invalid literal' (not naming the variable), and 0
    or -1 'no CPU to quantize on' on a cluster with CPUs."""
    from cluster.precache import n_quantize_workers
    for bad in ("abc", "0", "-1", "1.5"):
        monkeypatch.setenv("VOODOO_QUANT_WORKERS", bad)
        with pytest.raises(ValueError, match=r"VOODOO_QUANT_WORKERS=.*whole number >= 1"):
            n_quantize_workers()
    monkeypatch.setenv("VOODOO_QUANT_WORKERS", "1")
    assert n_quantize_workers() == 1


def test_precache_error_says_what_a_rerun_does(monkeypatch):
    """Every quantize actor killed (4 kills, replacements spent) read "130 candidate(s) failed
    after retries" though only 4 were tried, with no way forward; the message now says the
    actors died and that the same command resumes from the cache."""
    from cluster.precache import PrecacheError
    gone = {(f"blk.{i}.ffn_up.weight", "Q4_K"): "no live quantize actor" for i in range(5)}
    msg = str(PrecacheError({("blk.0.attn_q.weight", "Q8_0"): "ActorDiedError: killed",
                             **gone}, None))
    assert msg.startswith("6 candidate(s) not built: every quantize actor died")
    assert "5 never got one" in msg and "Run the same command again" in msg
    assert "blk.0.attn_q.weight Q8_0: ActorDiedError: killed" in msg
    assert "no live quantize actor" not in msg
    other = str(PrecacheError({("t", "Q8_0"): "ValueError: bad rows"}, None))
    assert "failed after retries" in other and "the same command retries the rest" in other
    assert "RAY_AUTH_MODE" not in msg
    # not one built, a token-sending driver on a RAY_ADDRESS cluster: likely a cluster without
    # token authentication turning the driver away (a Ray user's case); the way out is named
    from types import SimpleNamespace
    failures = {("blk.0.attn_q.weight", "Q8_0"): "ActorDiedError: killed", **gone}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    msg = str(PrecacheError(failures, SimpleNamespace(misses=6)))
    assert "Not one was built: if the cluster at RAY_ADDRESS does not use token " \
        "authentication, unset RAY_AUTH_MODE" in msg, msg
    assert "RAY_AUTH_MODE" not in str(PrecacheError(failures, SimpleNamespace(misses=60)))
    monkeypatch.delenv("RAY_AUTH_MODE")
    assert "RAY_AUTH_MODE" not in str(PrecacheError(failures, SimpleNamespace(misses=6)))
