"""The suite's own hygiene: what one test changes in the process does not
reach the next one (tests/conftest.py)."""

from __future__ import annotations

import os

pytest_plugins = ["pytester"]

CONFTEST = os.path.join(os.path.dirname(os.path.dirname(__file__)), "conftest.py")

# test_a does what `tandem serve` does in-process (test_serve_secret.py calls
# cmd_serve under capsys); test_b then logs from a thread, as the gateway's
# loop does after a request ends
INNER_TESTS = """
import logging
import threading

from tandem.cluster.observability.logging_setup import configure_logging


def test_a_cli_configures_logging(capsys):
    configure_logging("text")
    logging.getLogger("tandem.request").info("inside the test that configured it")
    assert "inside the test" in capsys.readouterr().err


def test_b_a_thread_logs_later():
    t = threading.Thread(target=logging.getLogger("tandem.request").info, args=("later",))
    t.start()
    t.join(10)
    root = logging.getLogger()
    assert root.level == logging.WARNING, root.level
    assert not [h for h in root.handlers if type(h) is logging.StreamHandler]
"""


def test_cli_logging_set_up_in_a_test_ends_with_it(pytester):
    """Fails without the conftest fixture: test_b hits the handler bound to
    test_a's closed capture stream ("--- Logging error ---") and finds the
    root logger still at INFO."""
    with open(CONFTEST) as f:
        pytester.makeconftest(f.read())
    pytester.makepyfile(test_inner=INNER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    output = result.stdout.str() + result.stderr.str()
    assert "Logging error" not in output, output
    result.assert_outcomes(passed=2)
