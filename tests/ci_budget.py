"""CI time is budgeted (a CI run stays well under 45 minutes): under
``CI=true`` the heaviest tests run a shortened form, and ``OMNI_SOAK_FULL=1``
runs them in full there too. Each test says what it shortens."""

from __future__ import annotations

import os

CI_SHORT = os.environ.get("CI") == "true" and os.environ.get("OMNI_SOAK_FULL") != "1"
