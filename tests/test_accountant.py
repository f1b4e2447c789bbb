"""The privacy accountant's numbers against independently computed values.

The oracle of a Gaussian mechanism is its exact privacy curve (Balle & Wang 2018, Thm. 8),
    delta(eps) = Phi(D/(2s) - eps s/D) - e^eps Phi(-D/(2s) - eps s/D),
evaluated here with scipy.stats and inverted with brentq (the library bisects its own log-space
form), and cross-checked with dp-accounting's discretised PLD accountant (which approaches the
exact value from above) and its RDP accountant (an upper bound, additive in 1/z^2).
"""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError
from scipy.optimize import brentq
from scipy.stats import norm

from pipeline.privacy.accountant import (
    Budget, Release, check_budget, compose, gaussian_epsilon, release_from_record,
)
from pipeline.privacy.release import Guarantee, PrivacyRelease

DELTA = 1e-5


def exact_epsilon(sensitivity: float, sigma: float, delta: float) -> float:
    """eps with delta(eps) = delta on the exact curve (scipy, brentq; independent of the library)."""
    r = sensitivity / sigma

    def gap(eps: float) -> float:
        return norm.cdf(r / 2 - eps / r) - math.exp(eps) * norm.cdf(-r / 2 - eps / r) - delta

    return brentq(gap, 0.0, 200.0, xtol=1e-13, rtol=1e-13)


def gaussian(sigma: float, sensitivity: float, epsilon: float = 1.0,
             guarantee: Guarantee = Guarantee.CERTIFIED, delta: float = 1e-6) -> PrivacyRelease:
    reasons = [] if guarantee is Guarantee.CERTIFIED else ["blockwise step"]
    return PrivacyRelease(mechanism="gaussian", sigma=sigma, sensitivity=sensitivity, epsilon=epsilon, delta=delta,
                          calibration="classical", guarantee=guarantee, reasons=reasons)


def dp_pld_epsilon(multipliers: list[float], delta: float) -> float:
    import dp_accounting
    from dp_accounting import pld

    acc = pld.PLDAccountant()
    for z in multipliers:
        acc.compose(dp_accounting.GaussianDpEvent(z))
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize("sigma,sensitivity", [(4.0, 1.0), (1.3, 0.5), (0.8, 1.0)])
def test_single_gaussian_release_matches_the_exact_curve(sigma, sensitivity):
    expected = exact_epsilon(sensitivity, sigma, DELTA)
    got = compose([gaussian(sigma, sensitivity)], "pld", DELTA).epsilon
    assert got == pytest.approx(expected, rel=1e-8)
    # The classical calibration's epsilon (sqrt(2 ln(1.25/delta)) / z) is a different, larger number.
    assert got < math.sqrt(2 * math.log(1.25 / DELTA)) / (sigma / sensitivity)


def test_pld_agrees_with_dp_accounting_discretised_pld():
    z = 1.5
    ours = compose([gaussian(z, 1.0)], "pld", DELTA).epsilon
    theirs = dp_pld_epsilon([z], DELTA)
    assert ours <= theirs + 1e-9 and theirs - ours <= 2e-3 * theirs  # discretisation is pessimistic and small


def test_ten_releases_compose_to_one_gaussian_with_multiplier_over_sqrt10():
    z = 5.0
    ten = [gaussian(z, 1.0)] * 10
    one = gaussian(z / math.sqrt(10), 1.0)
    pld_ten = compose(ten, "pld", DELTA)
    assert pld_ten.epsilon == pytest.approx(exact_epsilon(1.0, z / math.sqrt(10), DELTA), rel=1e-8)
    assert pld_ten.epsilon == pytest.approx(compose([one], "pld", DELTA).epsilon, rel=1e-10)
    assert compose(ten, "rdp", DELTA).epsilon == pytest.approx(compose([one], "rdp", DELTA).epsilon, rel=1e-9)
    assert pld_ten.epsilon == pytest.approx(dp_pld_epsilon([z] * 10, DELTA), rel=3e-3)
    single = compose([gaussian(z, 1.0)], "pld", DELTA).epsilon
    assert 3 * single < pld_ten.epsilon < 10 * single  # sub-linear, well above one release
    assert pld_ten.releases == 10 and pld_ten.certified == 10 and pld_ten.heuristic == 0


@pytest.mark.parametrize("z,count", [(5.0, 1), (6.0, 3), (8.0, 10), (20.0, 50)])
def test_pld_below_rdp_below_basic(z, count):
    """Releases calibrated classically (eps_i = sqrt(2 ln(1.25/delta_i)) / z < 1, delta_i =
    DELTA / count, so basic composition holds at DELTA): exact PLD <= RDP <= basic."""
    delta_i = DELTA / count
    eps_i = math.sqrt(2 * math.log(1.25 / delta_i)) / z
    assert eps_i < 1
    releases = [gaussian(z, 1.0, epsilon=eps_i, delta=delta_i)] * count
    pld = compose(releases, "pld", DELTA).epsilon
    rdp = compose(releases, "rdp", DELTA).epsilon
    basic = compose(releases, "basic", DELTA)
    assert pld <= rdp <= basic.epsilon
    assert basic.epsilon == pytest.approx(count * eps_i) and basic.delta == pytest.approx(DELTA)
    assert pld < 0.99 * rdp  # RDP's conversion is strictly looser


def test_huge_epsilon_is_fast_and_small_in_memory():
    """epsilon 10000 (z ~ 5e-4): the discretised PLD would need hundreds of GiB. Run in a child
    whose address space is capped at what it has after imports plus 512 MiB."""
    code = textwrap.dedent("""
        import math, resource, time
        from pipeline.privacy.accountant import Release, compose
        vm = [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmSize')][0] * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 512 * 2**20, vm + 512 * 2**20))
        t = time.perf_counter()
        huge = Release(sigma=1.0, sensitivity=None, epsilon=10000.0, delta=1e-5)
        pld = compose([huge], 'pld', 1e-5).epsilon
        rdp = compose([huge], 'rdp', 1e-5).epsilon
        print(pld, rdp, time.perf_counter() - t)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pld, rdp, seconds = map(float, done.stdout.split())
    from pipeline.privacy.noise import analytic_gaussian_sigma

    mu = 1 / analytic_gaussian_sigma(10000.0, 1e-5, 1.0)  # a legacy epsilon >= 1 is analytic
    assert math.isfinite(pld) and mu * mu / 2 <= pld <= rdp  # the privacy loss's mean mu^2/2 bounds it below
    assert seconds < 10


def test_exact_curve_inversion_in_log_space_for_large_mu():
    mu = 50.0  # e^eps overflows a float here; the library works in log space
    eps = gaussian_epsilon(mu, DELTA)
    assert mu * mu / 2 < eps < mu * mu / 2 + mu * math.sqrt(2 * math.log(1 / DELTA))


def test_release_from_record_reads_the_typed_release_only():
    certified = gaussian(2.0, 0.5)
    record = {"release": certified.model_dump(mode="json"), "noise": {"sigma": 9.0, "epsilon": 0.1, "delta": 1e-5}}
    assert release_from_record(record) == certified
    # No alias guessing: other names, or other places, are not a release.
    for untyped in ({"privacy": {"sigma": 1.2, "gamma": 0.5, "epsilon": 2.0, "delta": 1e-5}},
                    {"sigma": 1.2, "sensitivity": 0.5, "epsilon": 2.0, "delta": 1e-5}):
        assert release_from_record(untyped).guarantee is Guarantee.NONE
    with pytest.raises(ValidationError):
        release_from_record({"noise": {"noise_std": 1.2, "gamma": 0.5, "eps": 2.0, "delta": 1e-5}})
    # The one legacy schema (lfoci-newton's calibration record) is read, and never as certified.
    legacy = release_from_record({"noise": {"sigma": 1.2, "gamma": 0.5, "epsilon": 2.0, "delta": 1e-5}})
    assert legacy.guarantee is Guarantee.HEURISTIC and legacy.noise_multiplier == pytest.approx(2.4)
    with pytest.raises(ValidationError):
        release_from_record({"release": {"mechanism": "gaussian", "sigma": 1.0, "epsilon": 1.0, "delta": 1e-5,
                                         "guarantee": "certified", "noise_std": 2.0}})
    with pytest.raises(ValidationError):
        release_from_record({"release": {"mechanism": "gaussian", "sigma": 1.0, "epsilon": 1.0, "delta": 1e-5,
                                         "guarantee": "heuristic"}})  # heuristic needs reasons


def test_certified_and_heuristic_compose_but_count_apart():
    c, h = gaussian(4.0, 1.0), gaussian(4.0, 1.0, guarantee=Guarantee.HEURISTIC)
    none = PrivacyRelease.non_private()
    spend = compose([c, h, h], "pld", DELTA)
    assert (spend.certified, spend.heuristic, spend.non_private, spend.releases) == (1, 2, 0, 3)
    assert spend.epsilon == pytest.approx(compose([c, c, c], "pld", DELTA).epsilon)
    with_none = compose([c, none], "pld", DELTA)
    assert math.isinf(with_none.epsilon) and with_none.to_json()["epsilon"] is None
    assert with_none.epsilon_private == pytest.approx(compose([c], "pld", DELTA).epsilon)
    legacy = compose([Release(sigma=1.0, sensitivity=0.25, epsilon=1.0, delta=1e-6)], "pld", DELTA)
    assert legacy.heuristic == 1 and legacy.certified == 0  # untyped: never counted as certified


def test_check_budget_with_typed_releases():
    c = gaussian(1.0, 1.0)
    one = compose([c], "pld", DELTA).epsilon
    ok = check_budget([c], c, Budget(epsilon=3 * one))
    assert ok.allowed and ok.after.releases == 2
    refused = check_budget([c, c, c], c, Budget(epsilon=1.5 * one))
    assert not refused.allowed and "privacy budget exceeded" in refused.reason
    none = check_budget([], PrivacyRelease.non_private(), Budget(epsilon=10))
    assert not none.allowed and "allow_non_private" in none.reason
