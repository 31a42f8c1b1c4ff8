#!/usr/bin/env python3
"""Writes the fixed input of bench/script_cost.sh as Redis protocol on stdout.

    script_cost.py floodgate SHA CALLS BATCH KEYS SEED [RATE]
    script_cost.py cell CALLS BATCH KEYS SEED [RATE]

floodgate: CALLS `EVALSHA` calls of decide.lua, each deciding BATCH one-check requests
encoded the way src/limit/decide_call.rs encodes them (each distinct key sent once, keys
used once numbered first): a token bucket per client key, keys drawn from KEYS clients with
a seeded generator, named like the gateway names them (`bench:{10.x.y.z}:per_ip:tb`).
cell: CALLS x BATCH `CL.THROTTLE` calls of redis-cell on the same keys, with the same
bucket. RATE: tokens per second (default 1e9: the state expires a microsecond after it is
written; 1 keeps it). The environment's BURST: the bucket's depth (default 1e9).
"""
import os
import itertools
import random
import struct
import sys

BURST = int(os.environ.get("BURST", "1000000000"))


def command(*args):
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def client_key(client):
    ip = "10.%d.%d.%d" % (client >> 16 & 255, client >> 8 & 255, client & 255)
    return "bench:{%s}:per_ip:tb" % ip


def decide_call(sha, clients, rate):
    # Keys used once are numbered first, as src/limit/decide_call.rs numbers them.
    uses = {}
    for client in clients:
        uses[client_key(client)] = uses.get(client_key(client), 0) + 1
    keys = [k for k in uses if uses[k] == 1] + [k for k in uses if uses[k] > 1]
    index = {key: i + 1 for i, key in enumerate(keys)}
    picks = [index[client_key(client)] for client in clients]
    n_single = sum(1 for k in uses if uses[k] == 1)
    # The call: counter keys, single-use keys, one spec (two bytes each); the spec: token
    # bucket (3), `rate` per 1 s, BURST deep, cost 1, no lock-out, not shadow; then the plan:
    # per request its number of checks, then per check spec and key index (two bytes each);
    # consecutive requests on one key as one run: 0, spec, key, the run's length.
    header = struct.pack(">HHH", len(keys), n_single, 1) + struct.pack(">BdddddB", 3, rate, 1000000, BURST, 1, 0, 0)
    plan = b""
    for key_index, run in itertools.groupby(picks):
        length = len(list(run))
        if length == 1:
            plan += struct.pack(">HHH", 1, 1, key_index)
        else:
            plan += struct.pack(">HHHH", 0, 1, key_index, length)
    args = ["EVALSHA", sha, len(keys), *keys]
    return command(*args, header + plan)


def main():
    mode = sys.argv[1]
    if mode == "floodgate":
        sha, (calls, batch, n_keys, seed), extra = sys.argv[2], map(int, sys.argv[3:7]), sys.argv[7:]
    else:
        sha, (calls, batch, n_keys, seed), extra = None, map(int, sys.argv[2:6]), sys.argv[6:]
    rate = int(extra[0]) if extra else 1000000000
    rng = random.Random(seed)
    out = sys.stdout.buffer
    for _ in range(calls):
        clients = [rng.randrange(n_keys) for _ in range(batch)]
        if mode == "floodgate":
            out.write(decide_call(sha, clients, rate))
        else:
            for client in clients:
                # max_burst is the depth less one; `rate` per 1 s; cost 1.
                out.write(command("CL.THROTTLE", client_key(client), BURST - 1, rate, 1, 1))


if __name__ == "__main__":
    main()
