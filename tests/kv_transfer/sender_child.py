"""A sender in its own process, for the kill test: `python -m tests.kv_transfer.sender_child TRANSPORT`.

Prints the params of one published state as a JSON line, then serves. During a pull it prints
`MID` and stalls mid-transfer (tcp: before its third chunk; mooncake: while the receiver reads),
so the parent can SIGKILL it there. It exits on its own after 60 s if nobody kills it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from kv_transfer import tcp
from kv_transfer.interface import make_sender
from kv_transfer.sideband import SidebandSender
from tests.kv_transfer.helpers import config, hybrid_payload, metrics


def _stall_tcp() -> None:
    real_send, sent = tcp.send_chunk, 0

    def send_then_stall(chan, header: dict, body: memoryview) -> None:   # in the stream's thread
        nonlocal sent
        sent += 1
        if sent == 3:
            print("MID", flush=True)
            time.sleep(60)
        real_send(chan, header, body)

    tcp.send_chunk = send_then_stall


def _stall_sideband() -> None:
    async def push_then_stall(*args: object) -> None:
        print("MID", flush=True)
        await asyncio.sleep(60)

    SidebandSender._push = push_then_stall


async def main(transport: str) -> None:
    _stall_tcp() if transport == "tcp" else _stall_sideband()
    sender = make_sender(config(transport=transport), metrics())
    await sender.start()
    params = sender.publish(hybrid_payload("doomed"), 60.0, lambda request_id, reason: None)
    print(json.dumps(params.to_dict()), flush=True)
    await asyncio.sleep(60)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
