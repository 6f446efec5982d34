"""Every rank prints its pid and sleeps: for signal and cleanup tests."""

import os
import time

print(f"ready {os.getpid()}", flush=True)
time.sleep(600)
