"""Copied by the installer into the real-server venv as `_pdr_server_patches.py`, imported by a `.pth` file at
every interpreter start-up there. It does nothing unless the launcher's PDR_SERVER_PATCHES_ROOT is set; then it
activates server_patches.runtime from that checkout, so SGLang's spawned scheduler and detokenizer processes are
patched exactly like the launching one. Stdlib only.
"""

import os
import sys


def _activate() -> None:
    root = os.environ.get("PDR_SERVER_PATCHES_ROOT")
    if not root:
        return
    if root not in sys.path:
        sys.path.append(root)  # appended: never shadows anything the venv provides
    try:
        from server_patches import runtime

        names = runtime.activate()
    except Exception as e:  # site.py would print and carry on unpatched; a refusal must stop the process
        print(f"[server_patches] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(3)
    if os.environ.get("PDR_SERVER_PATCHES_VERBOSE") == "1":
        print(f"[server_patches] pid {os.getpid()}: active patches: {', '.join(names)}", file=sys.stderr, flush=True)


_activate()
