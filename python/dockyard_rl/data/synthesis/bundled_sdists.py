"""Small, real-looking source distributions for task synthesis without network access.

`make_toy_sdist(dest_dir) -> archive path` writes `toystats-1.0.tar.gz`: a package with a few
functions whose bugs its pytest suite catches (module functions, a class, parametrized tests, a
test class, a conftest fixture, test data in a file, a pytest.ini in the tests folder), laid out
like a PyPI sdist (one top folder, PKG-INFO, pyproject.toml).

The synthesis tests use it, and so can recipes: `bundled:toystats` in `synthesis.packages` (or
`--packages`) synthesizes from it (sdist_repos.fetch_sdist, `BUNDLED`). Its tasks are the
easiest honest task set we have: small pure functions, each bug visible in a few lines, graded
by real tests.

`make_toyseries_sdist(dest_dir)` writes `toyseries-1.0.tar.gz`: toystats' held-out partner, the
same kind of small multi-line functions and a class (`normalize`, `mode`, `Tally`, ...) with the
same test-suite features, none of toystats' functions (`bundled:toyseries`).

`make_pocketcalc_sdist(dest_dir)` writes `pocketcalc-1.0.tar.gz`: one-line functions whose names
say what they compute (`add`, `is_even`, `last`, ...), each checked by a test or two. A bug
mutated into one of them is the easiest honest task there is: the name, the code and the failing
assertion together give the fix away, yet only a patch that makes the tests pass is rewarded.
It is the learning run's task set (`bundled:pocketcalc`, docs/learning_run.md).

`make_pocketmath_sdist(dest_dir)` writes `pocketmath-1.0.tar.gz`: pocketcalc's held-out partner,
the same kind of one-line functions and tests (`triple`, `is_odd`, `second`, ...) but none of
pocketcalc's, so its tasks measure whether what the learning run learned on pocketcalc transfers
(`data.validation_synthesis: {packages: [bundled:pocketmath]}`).

`make_flaky_sdist(dest_dir)` writes `flakycalc-1.0.tar.gz`: a few one-line functions with
deterministic tests, plus `FLAKY_TEST`, a test that fails one run in three whatever the code.
The flaky-test checks of the synthesizer and the validator use it; it is not in `BUNDLED` (a
recipe has no use for it).
"""

from __future__ import annotations

import io
import pathlib
import tarfile

NAME, VERSION = "toystats", "1.0"

_FILES = {
    "PKG-INFO": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
    f"Summary: small statistics helpers\n",
    "pyproject.toml": f'[project]\nname = "{NAME}"\nversion = "{VERSION}"\n',
    "README.md": "# toystats\n\nSmall statistics helpers.\n",
    "docs/conf.py": "project = 'toystats'\n",
    "toystats/__init__.py": "from toystats.core import clamp, mean, median, running_max\n"
    "from toystats.window import Window\n",
    "toystats/core.py": '''"""Core helpers."""


def clamp(value, low, high):
    """value limited to [low, high]."""
    if low > high:
        raise ValueError("low must not exceed high")
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    if not values:
        raise ValueError("mean of an empty sequence")
    return sum(values) / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def running_max(values):
    result = []
    best = None
    for value in values:
        if best is None or value > best:
            best = value
        result.append(best)
    return result
''',
    "toystats/window.py": '''"""A sliding window."""


class Window:
    def __init__(self, size):
        if size <= 0:
            raise ValueError("size must be positive")
        self.size = size
        self.items = []

    def push(self, value):
        self.items.append(value)
        if len(self.items) > self.size:
            self.items = self.items[1:]
        return self

    def total(self):
        return sum(self.items)

    def full(self):
        return len(self.items) == self.size and self.size > 0
''',
    "tests/__init__.py": "",
    # An ini file inside tests/ moves pytest's default rootdir there (node ids would lose their
    # "tests/" prefix): the synthesizer must pin --rootdir.
    "tests/pytest.ini": "[pytest]\nmarkers =\n    slow: a slow test\n",
    "tests/conftest.py": """import pathlib

import pytest


@pytest.fixture
def samples():
    path = pathlib.Path(__file__).parent / "data" / "samples.txt"
    return [int(line) for line in path.read_text().split()]
""",
    "tests/data/samples.txt": "3\n1\n4\n1\n5\n9\n2\n6\n",
    "tests/test_core.py": """import pytest

from toystats import clamp, mean, median, running_max


@pytest.mark.parametrize("value, expected", [(5, 5), (-3, 0), (42, 10), (0, 0), (10, 10)])
def test_clamp(value, expected):
    assert clamp(value, 0, 10) == expected


def test_clamp_rejects_inverted_bounds():
    with pytest.raises(ValueError):
        clamp(1, 5, 0)


def test_mean(samples):
    assert mean(samples) == pytest.approx(31 / 8)


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])


class TestMedian:
    def test_odd(self):
        assert median([5, 1, 3]) == 3

    def test_even(self):
        assert median([4, 1, 3, 2]) == 2.5

    def test_samples(self, samples):
        assert median(samples) == 3.5


def test_running_max():
    assert running_max([1, 3, 2, 5, 4]) == [1, 3, 3, 5, 5]


def test_running_max_empty():
    assert running_max([]) == []
""",
    "tests/test_window.py": """import pytest

from toystats import Window


def test_push_keeps_the_last_items():
    window = Window(3)
    for value in range(5):
        window.push(value)
    assert window.items == [2, 3, 4]


def test_total():
    assert Window(2).push(1).push(2).push(3).total() == 5


def test_full():
    window = Window(2)
    assert not window.full()
    window.push(1).push(1)
    assert window.full()


def test_bad_size():
    with pytest.raises(ValueError):
        Window(0)
""",
}


SERIES_NAME = "toyseries"

# toystats' held-out partner: the same kind of small multi-line functions and a class, with the
# same test-suite features (parametrize, a test class, a conftest fixture reading a data file, a
# pytest.ini in tests/), none of toystats' functions.
_SERIES_FILES = {
    "PKG-INFO": f"Metadata-Version: 2.1\nName: {SERIES_NAME}\nVersion: {VERSION}\n"
    f"Summary: small helpers for number series\n",
    "pyproject.toml": f'[project]\nname = "{SERIES_NAME}"\nversion = "{VERSION}"\n',
    "README.md": "# toyseries\n\nSmall helpers for number series.\n",
    "toyseries/__init__.py": "from toyseries.series import cumulative_sum, mode, normalize, span\n"
    "from toyseries.tally import Tally\n",
    "toyseries/series.py": '''"""Series helpers."""


def normalize(values):
    """values scaled to [0, 1]."""
    low, high = min(values), max(values)
    if low == high:
        raise ValueError("all values are equal")
    return [(value - low) / (high - low) for value in values]


def cumulative_sum(values):
    result = []
    total = 0
    for value in values:
        total += value
        result.append(total)
    return result


def mode(values):
    if not values:
        raise ValueError("mode of an empty sequence")
    counts = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return max(counts, key=counts.get)


def span(values):
    if not values:
        return 0
    return max(values) - min(values)
''',
    "toyseries/tally.py": '''"""A capped tally."""


class Tally:
    def __init__(self, limit):
        if limit <= 0:
            raise ValueError("limit must be positive")
        self.limit = limit
        self.count = 0

    def add(self, amount=1):
        self.count += amount
        if self.count > self.limit:
            self.count = self.limit
        return self

    def remaining(self):
        return self.limit - self.count

    def done(self):
        return self.count >= self.limit
''',
    "tests/__init__.py": "",
    "tests/pytest.ini": "[pytest]\nmarkers =\n    slow: a slow test\n",
    "tests/conftest.py": """import pathlib

import pytest


@pytest.fixture
def readings():
    path = pathlib.Path(__file__).parent / "data" / "readings.txt"
    return [int(line) for line in path.read_text().split()]
""",
    "tests/data/readings.txt": "4\n2\n7\n2\n9\n2\n5\n",
    "tests/test_series.py": """import pytest

from toyseries import cumulative_sum, mode, normalize, span


@pytest.mark.parametrize("values, expected", [([0, 5, 10], [0.0, 0.5, 1.0]), ([3, 1], [1.0, 0.0])])
def test_normalize(values, expected):
    assert normalize(values) == pytest.approx(expected)


def test_normalize_rejects_equal_values():
    with pytest.raises(ValueError):
        normalize([4, 4])


def test_cumulative_sum():
    assert cumulative_sum([1, 2, 3, 4]) == [1, 3, 6, 10]


def test_cumulative_sum_empty():
    assert cumulative_sum([]) == []


class TestMode:
    def test_single_winner(self):
        assert mode([3, 1, 3, 2]) == 3

    def test_readings(self, readings):
        assert mode(readings) == 2

    def test_empty(self):
        with pytest.raises(ValueError):
            mode([])


def test_span(readings):
    assert span(readings) == 7


def test_span_empty():
    assert span([]) == 0
""",
    "tests/test_tally.py": """import pytest

from toyseries import Tally


def test_add_counts():
    assert Tally(10).add().add(3).count == 4


def test_add_is_capped():
    assert Tally(5).add(4).add(4).count == 5


def test_remaining():
    assert Tally(6).add(2).remaining() == 4


def test_done():
    tally = Tally(2)
    assert not tally.add().done()
    assert tally.add().done()


def test_bad_limit():
    with pytest.raises(ValueError):
        Tally(0)
""",
}


CALC_NAME = "pocketcalc"

_CALC_FILES = {
    "PKG-INFO": f"Metadata-Version: 2.1\nName: {CALC_NAME}\nVersion: {VERSION}\n"
    f"Summary: one-line arithmetic helpers\n",
    "pyproject.toml": f'[project]\nname = "{CALC_NAME}"\nversion = "{VERSION}"\n',
    "README.md": "# pocketcalc\n\nOne-line arithmetic helpers.\n",
    "pocketcalc/__init__.py": "from pocketcalc.calc import *  # noqa: F401,F403\n",
    "pocketcalc/calc.py": '''"""Arithmetic helpers, one line each."""


def add(a, b):
    return a + b


def subtract(a, b):
    return a - b


def multiply(a, b):
    return a * b


def double(x):
    return x * 2


def square(x):
    return x * x


def increment(x):
    return x + 1


def is_even(n):
    return n % 2 == 0


def is_positive(x):
    return x > 0


def is_adult(age):
    return age >= 18


def average(a, b):
    return (a + b) / 2


def first(items):
    return items[0]


def last(items):
    return items[-1]


def absolute(x):
    if x < 0:
        return -x
    return x


def maximum(a, b):
    if a > b:
        return a
    return b
''',
    "tests/__init__.py": "",
    "tests/test_calc.py": """\
from pocketcalc.calc import (absolute, add, average, double, first, increment,
                             is_adult, is_even, is_positive, last, maximum, multiply, square,
                             subtract)


def test_add():
    assert add(2, 3) == 5


def test_subtract():
    assert subtract(7, 4) == 3


def test_multiply():
    assert multiply(3, 4) == 12


def test_double():
    assert double(6) == 12


def test_square():
    assert square(5) == 25


def test_increment():
    assert increment(9) == 10


def test_is_even():
    assert is_even(4)


def test_is_even_odd():
    assert not is_even(7)


def test_is_positive():
    assert is_positive(3)


def test_is_positive_zero():
    assert not is_positive(0)


def test_is_adult():
    assert is_adult(18)


def test_is_adult_child():
    assert not is_adult(12)


def test_average():
    assert average(2, 6) == 4


def test_first():
    assert first([7, 8, 9]) == 7


def test_last():
    assert last([7, 8, 9]) == 9


def test_absolute_negative():
    assert absolute(-4) == 4


def test_absolute_positive():
    assert absolute(5) == 5


def test_maximum():
    assert maximum(3, 8) == 8


def test_maximum_first():
    assert maximum(9, 2) == 9
""",
}


MATH_NAME = "pocketmath"

# pocketcalc's held-out partner: the same kind of one-line functions and tests, none of them
# pocketcalc's, so a model trained on pocketcalc's tasks has never seen these.
_MATH_FILES = {
    "PKG-INFO": f"Metadata-Version: 2.1\nName: {MATH_NAME}\nVersion: {VERSION}\n"
    f"Summary: one-line math helpers\n",
    "pyproject.toml": f'[project]\nname = "{MATH_NAME}"\nversion = "{VERSION}"\n',
    "README.md": "# pocketmath\n\nOne-line math helpers.\n",
    "pocketmath/__init__.py": "from pocketmath.maths import *  # noqa: F401,F403\n",
    "pocketmath/maths.py": '''"""Math helpers, one line each."""


def triple(x):
    return x * 3


def cube(x):
    return x * x * x


def decrement(x):
    return x - 1


def half(x):
    return x / 2


def negate(x):
    return -x


def remainder(a, b):
    return a % b


def area(width, height):
    return width * height


def distance(a, b):
    return abs(a - b)


def is_odd(n):
    return n % 2 == 1


def is_negative(x):
    return x < 0


def is_zero(x):
    return x == 0


def is_teenager(age):
    return 13 <= age <= 19


def second(items):
    return items[1]


def count(items):
    return len(items)


def total(items):
    return sum(items)


def minimum(a, b):
    if a < b:
        return a
    return b
''',
    "tests/__init__.py": "",
    "tests/test_maths.py": """\
from pocketmath.maths import (area, count, cube, decrement, distance, half, is_negative, is_odd,
                              is_teenager, is_zero, minimum, negate, remainder, second, total,
                              triple)


def test_triple():
    assert triple(4) == 12


def test_cube():
    assert cube(3) == 27


def test_decrement():
    assert decrement(10) == 9


def test_half():
    assert half(10) == 5


def test_negate():
    assert negate(5) == -5


def test_remainder():
    assert remainder(17, 5) == 2


def test_area():
    assert area(3, 4) == 12


def test_distance():
    assert distance(2, 7) == 5


def test_distance_reversed():
    assert distance(7, 2) == 5


def test_is_odd():
    assert is_odd(7)


def test_is_odd_even():
    assert not is_odd(4)


def test_is_negative():
    assert is_negative(-3)


def test_is_negative_zero():
    assert not is_negative(0)


def test_is_zero():
    assert is_zero(0)


def test_is_zero_nonzero():
    assert not is_zero(5)


def test_is_teenager():
    assert is_teenager(13)


def test_is_teenager_child():
    assert not is_teenager(12)


def test_is_teenager_adult():
    assert not is_teenager(20)


def test_second():
    assert second([4, 5, 6]) == 5


def test_count():
    assert count([1, 2, 3]) == 3


def test_total():
    assert total([1, 2, 3]) == 6


def test_minimum():
    assert minimum(3, 8) == 3


def test_minimum_second():
    assert minimum(9, 2) == 2
""",
}


FLAKY_NAME = "flakycalc"
FLAKY_TEST = "tests/test_draw.py::test_fails_one_run_in_three"
FLAKY_FAIL_PROBABILITY = 1 / 3

_FLAKY_FILES = {
    "PKG-INFO": f"Metadata-Version: 2.1\nName: {FLAKY_NAME}\nVersion: {VERSION}\n"
    f"Summary: arithmetic helpers with a flaky test\n",
    "pyproject.toml": f'[project]\nname = "{FLAKY_NAME}"\nversion = "{VERSION}"\n',
    "flakycalc/__init__.py": "",
    "flakycalc/calc.py": '''"""Arithmetic helpers, one line each."""


def add(a, b):
    return a + b


def subtract(a, b):
    return a - b


def is_positive(x):
    return x > 0
''',
    "tests/__init__.py": "",
    "tests/test_calc.py": """from flakycalc.calc import add, is_positive, subtract


def test_add():
    assert add(2, 3) == 5


def test_subtract():
    assert subtract(7, 4) == 3


def test_is_positive():
    assert is_positive(3)


def test_is_positive_zero():
    assert not is_positive(0)
""",
    # Each sandboxed run starts from a fresh copy of the repository with the same environment
    # (the runner even pins PYTHONHASHSEED=0), so nothing in the files, the environment or
    # hash() differs between runs. os.urandom does: it reads the kernel's random generator
    # (getrandom(2), which the sandbox does not filter) anew in every process.
    "tests/test_draw.py": """import os
import random


def test_fails_one_run_in_three():
    draw = random.Random(os.urandom(16)).randrange(3)
    assert draw != 0, "the one-in-three draw came up"
""",
}


def make_toy_sdist(dest_dir: pathlib.Path, *, src_layout: bool = False) -> pathlib.Path:
    """Writes toystats into `dest_dir` and returns the archive's path. `src_layout` puts the
    package under src/ (as many modern projects do)."""
    return _write_sdist(dest_dir, NAME, _FILES, src_layout=src_layout)


def make_toyseries_sdist(dest_dir: pathlib.Path) -> pathlib.Path:
    """Writes toyseries (toystats' held-out partner) into `dest_dir`; returns the archive."""
    return _write_sdist(dest_dir, SERIES_NAME, _SERIES_FILES)


def make_pocketcalc_sdist(dest_dir: pathlib.Path) -> pathlib.Path:
    """Writes pocketcalc into `dest_dir` and returns the archive's path."""
    return _write_sdist(dest_dir, CALC_NAME, _CALC_FILES)


def make_pocketmath_sdist(dest_dir: pathlib.Path) -> pathlib.Path:
    """Writes pocketmath (pocketcalc's held-out partner) into `dest_dir`; returns the archive."""
    return _write_sdist(dest_dir, MATH_NAME, _MATH_FILES)


def make_flaky_sdist(dest_dir: pathlib.Path) -> pathlib.Path:
    """Writes flakycalc into `dest_dir` and returns the archive's path."""
    return _write_sdist(dest_dir, FLAKY_NAME, _FLAKY_FILES)


def _write_sdist(
    dest_dir: pathlib.Path, name: str, files: dict[str, str], *, src_layout: bool = False
) -> pathlib.Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    archive = dest_dir / f"{name}-{VERSION}.tar.gz"
    files = {
        (f"src/{path}" if src_layout and path.startswith(f"{name}/") else path): text
        for path, text in files.items()
    }
    with tarfile.open(archive, "w:gz") as tarred:
        for path, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{VERSION}/{path}")
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 1700000000
            tarred.addfile(info, io.BytesIO(data))
    return archive


# Name -> writer(dest_dir) -> archive: the packages `bundled:<name>` refers to.
BUNDLED = {
    NAME: make_toy_sdist,
    CALC_NAME: make_pocketcalc_sdist,
    MATH_NAME: make_pocketmath_sdist,
    SERIES_NAME: make_toyseries_sdist,
}
