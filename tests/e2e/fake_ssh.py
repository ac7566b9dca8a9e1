"""Stands in for ``ssh`` in tests: logs the host and runs the remote command on this machine.

Called as the launcher calls ssh: ``fake_ssh.py [-tt] HOST COMMAND``. The command runs under
``bash -c`` (as sshd runs it under the login shell), with stdin passed through, so both the
launcher's config push (``cat > FILE``) and its ``cd WORKDIR && python ...`` commands work.
"""

import os
import sys

args = sys.argv[1:]
if args[:1] == ["-tt"]:
    args = args[1:]
host, command = args
with open(os.environ["FAKE_SSH_LOG"], "a") as log:
    log.write(f"{host}\t{command}\n")
os.execvp("bash", ["bash", "-c", command])
