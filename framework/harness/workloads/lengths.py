"""Token-length distributions for prompts and outputs.

A length is given in the workload config as

- ``64``: fixed;
- ``[16, 128]``: uniform over the inclusive range;
- ``{dist: fixed, value: 64}``, ``{dist: uniform, min: 16, max: 128}``;
- ``{dist: normal, mean: 64, std: 16}`` and ``{dist: lognormal, mean: 64, std: 32}``, with
  ``mean``/``std`` those of the lengths themselves (a lognormal's underlying parameters are
  derived), rounded and clipped to ``[min, max]`` (``min`` defaults to 1, ``max`` to none);
- ``{dist: zipf, a: 1.2, min: 1, max: 512}``: ``P(min + k - 1) ~ k^-a`` for ``k = 1 ..
  max - min + 1``, a bounded Zipf law (many short, a heavy tail of long).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from framework.common.config import is_finite_number, is_int

DISTRIBUTIONS = ("fixed", "uniform", "normal", "lognormal", "zipf")
#: Required and optional keys of each distribution's dict form.
_KEYS = {"fixed": ({"value"}, set()), "uniform": ({"min", "max"}, set()),
         "normal": ({"mean", "std"}, {"min", "max"}), "lognormal": ({"mean", "std"}, {"min", "max"}),
         "zipf": ({"a", "max"}, {"min"})}


@dataclass(frozen=True)
class LengthDist:
    dist: str
    min: int = 1
    max: int | None = None
    value: int = 0
    mean: float = 0.0
    std: float = 0.0
    a: float = 1.0

    @classmethod
    def parse(cls, spec: Any, what: str) -> LengthDist:
        """A distribution from its config form; ``what`` names the option in errors."""
        if isinstance(spec, bool):
            raise ValueError(f"{what}: expected a length, got {spec!r}")
        if isinstance(spec, int):
            return cls._checked(what, dist="fixed", value=spec, min=spec, max=spec)
        if isinstance(spec, Sequence) and not isinstance(spec, str):
            if len(spec) != 2:
                raise ValueError(f"{what}: a range is [min, max], got {list(spec)!r}")
            return cls._checked(what, dist="uniform", min=spec[0], max=spec[1])
        if isinstance(spec, Mapping):
            spec = dict(spec)
            dist = spec.pop("dist", None)
            if dist not in DISTRIBUTIONS:
                raise ValueError(f"{what}: dist must be one of {', '.join(DISTRIBUTIONS)}; got {dist!r}")
            required, optional = _KEYS[dist]
            unknown = set(spec) - required - optional
            if unknown:
                raise ValueError(f"{what}: unknown key(s) {sorted(unknown)} for dist {dist}; "
                                 f"valid: {sorted(required | optional)}")
            missing = required - set(spec)
            if missing:
                raise ValueError(f"{what}: dist {dist} needs {', '.join(repr(k) for k in sorted(missing))}")
            if dist == "fixed":
                return cls._checked(what, dist="fixed", value=spec["value"], min=spec["value"], max=spec["value"])
            return cls._checked(what, dist=dist, **spec)
        raise ValueError(f"{what}: expected an int, [min, max] or {{dist: ...}}; got {spec!r}")

    @classmethod
    def _checked(cls, what: str, **kw: Any) -> LengthDist:
        d = cls(**kw)
        for name in ("min", "max", "value"):
            v = getattr(d, name)
            # min always needs one ([null, 16] is no range); max and value only where the dist uses them.
            if (v is not None or name == "min") and not is_int(v):
                raise ValueError(f"{what}: {name} must be an integer, got {v!r}")
        for name in ("mean", "std", "a"):
            if not is_finite_number(getattr(d, name)):
                raise ValueError(f"{what}: {name} must be a number, got {getattr(d, name)!r}")
        if d.min < 1:
            raise ValueError(f"{what}: lengths must be >= 1, got min={d.min}")
        if d.max is not None and d.max < d.min:
            raise ValueError(f"{what}: max={d.max} is below min={d.min}")
        if d.dist in ("uniform", "zipf") and d.max is None:
            raise ValueError(f"{what}: dist {d.dist} needs 'max'")  # the [min, max] form can give None
        if d.dist in ("normal", "lognormal") and not (d.mean > 0 and d.std >= 0):
            raise ValueError(f"{what}: dist {d.dist} needs mean > 0 and std >= 0, got mean={d.mean}, std={d.std}")
        if d.dist == "zipf" and not d.a > 0:
            raise ValueError(f"{what}: zipf exponent a must be > 0, got {d.a}")
        return d

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` integer lengths within ``[min, max]``."""
        if self.dist == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.dist == "uniform":
            return rng.integers(self.min, self.max + 1, size=n)
        if self.dist == "zipf":
            k = np.arange(1, self.max - self.min + 2, dtype=np.float64)
            weights = k ** -self.a
            return self.min + rng.choice(len(k), size=n, p=weights / weights.sum())
        if self.dist == "normal":
            x = rng.normal(self.mean, self.std, size=n)
        else:  # lognormal with the requested mean and std of the lengths
            sigma2 = math.log1p((self.std / self.mean) ** 2)
            x = rng.lognormal(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2), size=n)
        return np.clip(np.rint(x), self.min, self.max if self.max is not None else None).astype(np.int64)


def check_bound(what: str, dist: LengthDist, limit: int, why: str, drawn: int | None = None) -> None:
    """ValueError naming ``workload.what`` when ``dist`` reaches past ``limit`` (``why`` says what sets it): by its
    bound (``max``, a fixed value), or for one without a bound by the longest length it ``drawn``."""
    longest = dist.max if drawn is None else drawn
    if longest is None or longest <= limit:
        return
    if drawn is not None:
        stated, fix = f": dist {dist.dist} without a max drew {drawn},", "give it a max"
    else:
        stated, fix = (f"={dist.value} is" if dist.dist == "fixed" else f": max={dist.max} is"), "lower it"
    raise ValueError(f"workload.{what}{stated} beyond {why}: {fix} or raise engine.max_model_len")
