"""Forward every Ethernet frame between two interfaces, each way after a fixed delay: a wire with
latency, for kernels without netem (svip_bench/two_nodes.py runs it in the namespace
between the two nodes).

    python frame_relay.py IF_A IF_B DELAY_MS
"""

from __future__ import annotations

import asyncio
import socket
import sys

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # a frame this socket's own interface sent: not to be forwarded back


def _open(ifname: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.bind((ifname, 0))
    sock.setblocking(False)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return sock


async def relay(if_a: str, if_b: str, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    a, b = _open(if_a), _open(if_b)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                frame, address = src.recvfrom(65536)
            except BlockingIOError:
                return
            if address[2] == PACKET_OUTGOING:
                continue
            if delay_s > 0:
                loop.call_later(delay_s, dst.send, frame)
            else:
                dst.send(frame)

    loop.add_reader(a, pump, a, b)
    loop.add_reader(b, pump, b, a)
    print("relay up", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(relay(sys.argv[1], sys.argv[2], float(sys.argv[3]) / 1000))
