"""A stand-in third-party package that exists only inside the `moonphase_task_image` test image.

The executor's own interpreter does not have it, so a repository whose tests import it can only
be scored inside that image (tests/task_images_test.py).
"""

SYNODIC_MONTH_DAYS = 29.530588853
PHASES = (
    "new",
    "waxing crescent",
    "first quarter",
    "waxing gibbous",
    "full",
    "waning gibbous",
    "last quarter",
    "waning crescent",
)


def phase_index(days_since_new_moon: float) -> int:
    """Which of the eight named phases a moon `days_since_new_moon` old is in."""
    age = days_since_new_moon % SYNODIC_MONTH_DAYS
    return int(age / SYNODIC_MONTH_DAYS * 8 + 0.5) % 8
