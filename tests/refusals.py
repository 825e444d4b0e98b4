"""A command that must refuse its input, run in the test's process: the entry point's ``main(argv)``, the function
``python -m MODULE ARGS`` calls, without a process start-up per refusal. The process boundary itself (exit status
of the interpreter, launchers, several ranks) is tested where it is the point: test_cli.py, test_cluster.py."""
from typing import Tuple

import pytest


def refused(main, argv, capsys) -> Tuple[str, str, str]:
    """``main(argv)`` ends with status 2, no traceback and one ``error:`` line on stderr: ``(that line, stdout,
    stderr)``."""
    capsys.readouterr()  # what earlier steps of the test printed is not this command's
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0], out, err


def refusal(main, argv, capsys) -> str:
    """The one ``error:`` line of ``main(argv)``, which must refuse its input (see ``refused``)."""
    return refused(main, argv, capsys)[0]
