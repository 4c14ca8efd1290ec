"""The host's cores kept out of deep idle states while the server runs (`KILN_CPU_LATENCY_US`, off by default).

Why (issue #30, docs/performance.md "after idle"): a served request crosses about ten hand-offs between processes
and threads (client, frontend, core, executor, GPU, and back), each a wake-up of a sleeping thread. On the H200
host a round trip between two processes took 16 us back-to-back but 214 us after 1 s without traffic
(`load_tests/wakeup_latency.py --idle-s 1`): idle cores sink into deep C-states and each hop first waits for one to
wake. A request after a quiet spell, the first after a model is ready among them, pays that at every hop.

How: Linux's PM QoS interface. While a process keeps /dev/cpu_dma_latency open with a bound written to it (in
microseconds), no core enters an idle state slower to leave than that (tuned's latency-performance profile does
the same, host-wide). The cost is power: idle cores stay in shallow states. It needs write access to the device
(root, or a container given it); without it the server logs why and runs as before.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Mapping
from typing import BinaryIO

log = logging.getLogger("kiln.server")

PM_QOS_DEVICE = "/dev/cpu_dma_latency"


def hold_cpu_latency(env: Mapping[str, str] = os.environ, device: str = PM_QOS_DEVICE) -> BinaryIO | None:
    """The open PM QoS request for `KILN_CPU_LATENCY_US` (keep it: closing it ends the bound), or None when the
    variable is unset, not a whole number of microseconds >= 0, or the device cannot be written (logged)."""
    value = env.get("KILN_CPU_LATENCY_US", "").strip()
    if not value:
        return None
    if not value.isdigit():
        log.warning("KILN_CPU_LATENCY_US=%r is not a whole number of microseconds >= 0: ignored", value)
        return None
    try:
        request = open(device, "wb", buffering=0)  # noqa: SIM115 - held open for the server's life
    except OSError as e:
        log.warning("KILN_CPU_LATENCY_US=%s: cannot open %s (%s): the cores keep their idle states", value, device, e)
        return None
    try:
        request.write(struct.pack("i", int(value)))
    except OSError as e:
        request.close()
        log.warning("KILN_CPU_LATENCY_US=%s: %s refused the bound (%s)", value, device, e)
        return None
    log.info("KILN_CPU_LATENCY_US=%s: cores stay out of idle states slower to leave than %s us while the server "
             "runs (%s)", value, value, device)
    return request
