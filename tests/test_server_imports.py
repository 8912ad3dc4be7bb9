"""The server side never imports torch: its image needs none and it starts fast."""

from __future__ import annotations

import subprocess
import sys


def test_server_cli_and_byte_client_do_not_import_torch():
    code = (
        "import sys\n"
        "import weightserver, weightserver.cli, weightserver.server, weightserver.service\n"
        "import weightclient, weightclient.service_client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensordict', 'numpy'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
