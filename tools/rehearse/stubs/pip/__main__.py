"""``python -m pip install ...`` in a rehearsed job: nothing is installed, nothing is fetched.

The rehearsal is offline; what a rehearsed job runs through nox runs in the Python that runs the
rehearsal (the nox stub), which already has what it needs.
"""

import sys

print(f"rehearsal pip stub: not run (offline): pip {' '.join(sys.argv[1:])}")
