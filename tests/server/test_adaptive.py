"""Traffic-adaptive profiles: the histogram, the fit, and a real server that refits and hot-swaps under load.

The server test starts `python -m server` with KILN_ADAPTIVE_PROFILES=1 (a short interval and a small
request threshold), sends requests of two length clusters from several threads without pause, and waits
until /metrics shows a rebuilt plan with several profiles: every request before, during and after the swap
must be answered exactly, and the statistics must continue across the swap (same version, same counters).
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import numpy as np
import pytest
import tritonclient.http as http

from server.core.adaptive import ShapeHistogram, close_enough, fit_profiles, same_profiles, variable_dims
from server.core.settings import AdaptiveSettings
from tests.server.conftest import ServerProcess, examples, run_server
from tests.server.test_batching import _ragged_config, _ragged_model

BASE = {"X": ([1, 1], [8, 1], [8, 4096])}


def _histogram(lengths: list[int]) -> ShapeHistogram:
    histogram = ShapeHistogram(variable_dims(BASE, batched=True))
    for n in lengths:
        histogram.record({"X": np.zeros((1, n), np.float32)})
    return histogram


def test_fit_gives_nested_profiles_at_the_traffic_quantiles_and_keeps_the_full_range():
    histogram = _histogram([8] * 50 + [16] * 30 + [100] * 15 + [400] * 5)
    assert histogram.requests == 100 and histogram.variable_dims == {"X": [1]}
    profiles = fit_profiles(histogram, BASE, 4)
    assert [p["X"][2][1] for p in profiles] == [8, 16, 400, 4096]  # quantiles .25/.5 -> 8, .75 -> 16, 1 -> 400
    assert [p["X"][1][1] for p in profiles] == [8, 16, 400, 400]  # opt = the cut; the catch-all opts the max seen
    assert all(p["X"][0] == [1, 1] and p["X"][2][0] == 8 for p in profiles)  # batch range untouched
    assert same_profiles(profiles, fit_profiles(histogram, BASE, 4))
    assert not same_profiles(profiles, fit_profiles(_histogram([8, 9, 10, 11]), BASE, 4))
    wobble = fit_profiles(_histogram([9] * 50 + [16] * 30 + [100] * 15 + [420] * 5), BASE, 4)
    assert close_enough(wobble, profiles)  # maxes 9/16/420 vs 8/16/400: within 25%, no rebuild for that
    assert not close_enough(fit_profiles(_histogram([8] * 50 + [40] * 50), BASE, 4), profiles)


def test_no_traffic_or_no_variable_dim_means_no_fit():
    assert fit_profiles(_histogram([]), BASE, 4) is None
    fixed = ShapeHistogram(variable_dims({"X": ([1, 4], [8, 4], [8, 4])}, batched=True))
    fixed.record({"X": np.zeros((2, 4))})
    assert fixed.requests == 0 and fit_profiles(fixed, {"X": ([1, 4], [8, 4], [8, 4])}, 4) is None


def test_adopting_a_histogram_continues_its_counts():
    old, new = _histogram([4, 4, 30]), _histogram([30])
    new.adopt(old)
    assert new.requests == 4 and new.counts[("X", 1)] == {4: 2, 30: 2}


def test_settings_from_the_environment():
    settings = AdaptiveSettings.from_env({"KILN_ADAPTIVE_PROFILES": "1", "KILN_ADAPTIVE_INTERVAL_S": "2.5",
                                          "KILN_ADAPTIVE_MIN_REQUESTS": "10"})
    assert (settings.enabled, settings.interval_s, settings.min_requests, settings.max_profiles) == (True, 2.5, 10, 4)
    assert not AdaptiveSettings.from_env({}).enabled
    with pytest.raises(ValueError, match="KILN_ADAPTIVE_MIN_REQUESTS must be a int"):
        AdaptiveSettings.from_env({"KILN_ADAPTIVE_MIN_REQUESTS": "many"})
    with pytest.raises(ValueError, match="max_profiles"):
        AdaptiveSettings(True, 1.0, 1, 99)


# -- a real server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adaptive_server(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("adaptive")
    examples.write_model(base / "models", "ragged", _ragged_model(concat=False), _ragged_config("ragged"))
    env = {"KILN_ADAPTIVE_PROFILES": "1", "KILN_ADAPTIVE_INTERVAL_S": "0.5", "KILN_ADAPTIVE_MIN_REQUESTS": "60",
           "KILN_ADAPTIVE_MAX_PROFILES": "2"}
    args = ["--allow-grpc", "false", "--plan-cache-dir", str(base / "plans"), "--drain-delay", "0"]
    with run_server(base / "models", base / "server.log", None, args, env=env) as server:
        yield server


def _metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(server.metrics_url, timeout=5).text
    match = re.search(rf'^{name}{{model="ragged",version="1"}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else -1.0


def test_refit_and_hot_swap_under_load_fails_no_request(adaptive_server: ServerProcess):
    url = adaptive_server.http_url
    assert _metric(adaptive_server, "kiln_optimization_profiles") == 1
    stop = threading.Event()
    answered, wrong = [0], []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        connection = http.InferenceServerClient(url)
        while not stop.is_set():
            n = int(rng.choice([4, 6, 8])) if rng.random() < 0.7 else int(rng.integers(60, 65))
            x = rng.integers(0, 100, size=(1, n)).astype(np.float32)
            tensor = http.InferInput("X", [1, n], "FP32")
            tensor.set_data_from_numpy(x)
            try:
                result = connection.infer("ragged", [tensor])
                ok = (np.array_equal(result.as_numpy("Y"), 2 * x)
                      and np.array_equal(result.as_numpy("Z"), x.sum(axis=1, keepdims=True)))
            except Exception as e:  # noqa: BLE001 - any failure is what this test looks for
                ok, x = False, e
            with lock:
                answered[0] += 1
                if not ok:
                    wrong.append(x)

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while _metric(adaptive_server, "kiln_profile_rebuilds_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        swapped_at = answered[0]
        time.sleep(1.0)  # keep the load on after the swap
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert _metric(adaptive_server, "kiln_profile_rebuilds_total") >= 1, adaptive_server.log()[-3000:]
    assert _metric(adaptive_server, "kiln_optimization_profiles") == 3  # cuts at the 50% and 100% lengths + full
    assert wrong == [] and answered[0] > swapped_at
    stats = http.InferenceServerClient(url).get_inference_statistics("ragged")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == answered[0]  # counters carried across the swap
    assert stats["inference_stats"]["fail"]["count"] == 0
    assert "adaptive profiles: model 'ragged' version 1 now runs a plan with 3 profiles" in adaptive_server.log()
