"""A custom reward in Python: the order id the model reports must occur in
the email (no invented ids); a null id is right only when the email has
none. Reports whether an id was given as a metric.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "python"))
from temper_reward import reward, serve  # noqa: E402


@reward
def grounded(parsed, prompt, **_):
    """The order id the model reports must occur in the email (none: the email has none)."""
    email = prompt[-1]["content"]
    try:
        got = json.loads(parsed or "")
    except ValueError:
        return 0.0, {"has_id": 0.0}
    order_id = got.get("order_id") if isinstance(got, dict) else None
    if order_id is None:
        return (0.0 if "#" in email else 1.0), {"has_id": 0.0}
    return (1.0 if str(order_id) in email else 0.0), {"has_id": 1.0}


if __name__ == "__main__":
    serve()
