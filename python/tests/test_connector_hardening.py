"""Connector behaviour after failures, through the module's own connectors (kvferry._kvferry):
real bootstrap server, real engines over loopback TCP, host pools in numpy arrays."""

import json
import time
import urllib.request

import numpy as np

from kvferry import _kvferry as K

PAGE_SIZE, NUM_PAGES, AUX_ROWS, STATE_SLOTS = 4, 16, 4, 2
# Room states as the module numbers them (kvferry.RoomState).
WAITING_FOR_INPUT, SUCCESS, FAILED = 1, 3, 4


def hybrid_geometry(kv_heads):
    """Two full-attention layers and six linear-attention layers (a Qwen3-Next-like shape)."""
    return dict(attention="mha", num_layers=2, num_kv_heads=kv_heads, head_dim=8,
                dtype="bfloat16", num_linear_layers=6, full_attention_interval=4,
                linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_conv_kernel_dim=4,
                linear_state_dtype="float32")


# Bytes of one state slot of each kind at TP 1 (conv: (2 * 4 * 8 + 8 * 8) channels x 3 taps x
# 2 bytes; recurrent: 8 heads x 8 x 8 x 4 bytes); a rank at TP t holds 1/t of each.
CONV_SLOT, RECURRENT_SLOT = 128 * 3 * 2, 8 * 8 * 8 * 4


class Pools:
    """One rank's KV pool, aux rows and state pool, each filled with one byte."""

    def __init__(self, kv_heads, tp, kv_fill, state_fill):
        page_bytes = PAGE_SIZE * kv_heads * 8 * 2
        self.kv = [np.full(NUM_PAGES * page_bytes, kv_fill, np.uint8) for _ in range(4)]
        self.aux = [np.zeros(AUX_ROWS * 8, np.uint8), np.zeros(AUX_ROWS * 8, np.uint8)]
        self.state = ([np.full(STATE_SLOTS * CONV_SLOT // tp, state_fill, np.uint8)
                       for _ in range(6)] +
                      [np.full(STATE_SLOTS * RECURRENT_SLOT // tp, state_fill, np.uint8)
                       for _ in range(6)])
        self.args = dict(geometry=hybrid_geometry(kv_heads), page_size=PAGE_SIZE,
                         num_pages=NUM_PAGES, kv_bases=[a.ctypes.data for a in self.kv],
                         aux_field_bytes=[8, 8], aux_bases=[a.ctypes.data for a in self.aux],
                         num_aux_rows=AUX_ROWS, state_bases=[a.ctypes.data for a in self.state],
                         num_state_slots=STATE_SLOTS)

    def mark_aux_row(self, row, room):
        self.aux[1][row * 8:(row + 1) * 8] = np.frombuffer(np.uint64(room).tobytes(), np.uint8)


def register_unreachable_rank(bootstrap_address, tp_rank):
    """Registers prefill TP rank `tp_rank` of 2 at an address nothing listens on, as a rank
    that has since gone away would have."""
    body = json.dumps(dict(tp_rank=tp_rank, cp_rank=0, pp_rank=0, engine_address="127.0.0.1:1",
                           name="gone", tp_size=2, cp_size=1, pp_size=1, page_size=PAGE_SIZE,
                           kv_dtype="bfloat16", num_kv_heads=2)).encode()
    request = urllib.request.Request("http://" + bootstrap_address + "/route", data=body,
                                     method="PUT")
    urllib.request.urlopen(request, timeout=5).read()


def test_pairing_retried_after_a_failed_rank_gives_each_rank_its_own_state_part():
    """Prefill TP 2 -> decode TP 1 of a hybrid model: decode's first pairing fails at the
    second prefill rank (registered where nothing listens); once that rank registers for real,
    the next room pairs again and each prefill rank's half of the linear-attention state lands
    in its own half of decode's slot (a retry once reused the failed attempt's per-rank
    entries, and rank 1's half landed in rank 0's)."""
    server = K.BootstrapServer()
    rank0 = Pools(1, 2, 0x10, 0xA0)
    prefill0 = K.PrefillConnector(**rank0.args, bootstrap_address=server.address, tp_rank=0,
                                  tp_size=2, total_kv_heads=2)
    register_unreachable_rank(server.address, 1)
    decode_pools = Pools(2, 1, 0, 0)
    decode = K.DecodeConnector(**decode_pools.args, tp_size=1, kv_path="direct",
                               bootstrap_timeout=5.0, waiting_timeout=5.0)
    rank1 = None
    prefill1 = None
    try:
        decode.create_receiver(100, server.address, np.array([0], np.int32), 0, 0)
        assert decode.wait(100, SUCCESS, 5.0)[0] == FAILED
        rank1 = Pools(1, 2, 0x11, 0xB1)
        prefill1 = K.PrefillConnector(**rank1.args, bootstrap_address=server.address,
                                      tp_rank=1, tp_size=2, total_kv_heads=2)
        room = 101
        decode.create_receiver(room, server.address, np.array([1], np.int32), 1, 1)
        for prefill, pools in ((prefill0, rank0), (prefill1, rank1)):
            pools.mark_aux_row(1, room)
            prefill.create_sender(room, 1, 1)
        for prefill in (prefill0, prefill1):
            assert prefill.wait(room, WAITING_FOR_INPUT, 5.0)[0] == WAITING_FOR_INPUT
        for prefill in (prefill0, prefill1):
            prefill.send_chunk(room, 0, np.array([2], np.int32), 1)
        assert decode.wait(room, SUCCESS, 5.0)[0] == SUCCESS
        # Slot 1 of decode's first recurrent buffer: prefill rank 0's half, then rank 1's.
        recurrent = decode_pools.state[6][RECURRENT_SLOT:2 * RECURRENT_SLOT]
        half = RECURRENT_SLOT // 2
        assert set(recurrent[:half].tolist()) == {0xA0}
        assert set(recurrent[half:].tolist()) == {0xB1}
    finally:
        for connector in (prefill0, prefill1, decode):
            if connector is not None:
                connector.close()


def attention_pools(kv_heads, kv_fill, room_in_aux_row=None):
    """A rank's pools of a two-layer attention-only model, KV filled with one byte."""
    geometry = dict(attention="mha", num_layers=2, num_kv_heads=kv_heads, head_dim=8,
                    dtype="bfloat16")
    page_bytes = PAGE_SIZE * kv_heads * 8 * 2
    kv = [np.full(NUM_PAGES * page_bytes, kv_fill, np.uint8) for _ in range(4)]
    aux = [np.zeros(AUX_ROWS * 8, np.uint8), np.zeros(AUX_ROWS * 8, np.uint8)]
    if room_in_aux_row is not None:
        aux[1][0:8] = np.frombuffer(np.uint64(room_in_aux_row).tobytes(), np.uint8)
    args = dict(geometry=geometry, page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                kv_bases=[a.ctypes.data for a in kv], aux_field_bytes=[8, 8],
                aux_bases=[a.ctypes.data for a in aux], num_aux_rows=AUX_ROWS)
    return args, kv, aux


def test_context_parallel_rank_with_no_pages_through_the_staging_ring():
    """Prefill TP 2 x CP 2 -> decode TP 1 through decode's staging ring, a one-page request:
    the CP rank whose share of the pages is empty still finishes its part (its last chunk,
    with no KV, once asked for a staging region of zero bytes and failed the room)."""
    server = K.BootstrapServer()
    room, keep, prefills = 5, [], []
    decode = None
    try:
        for cp in range(2):
            for tp in range(2):
                args, kv, aux = attention_pools(1, 0x11, room_in_aux_row=room)
                keep.append((kv, aux))
                prefills.append(K.PrefillConnector(
                    **args, bootstrap_address=server.address, start_bootstrap_server=False,
                    tp_rank=tp, tp_size=2, cp_rank=cp, cp_size=2))
        args, decode_kv, decode_aux = attention_pools(2, 0)
        decode = K.DecodeConnector(**args, tp_size=1, kv_path="staging", staging_bytes=1 << 20,
                                   bootstrap_timeout=5.0, waiting_timeout=5.0)
        decode.create_receiver(room, server.address, np.array([2], np.int32), 1)
        for prefill in prefills:
            prefill.create_sender(room, 1)
        for prefill in prefills:
            assert prefill.wait(room, WAITING_FOR_INPUT, 5.0)[0] == WAITING_FOR_INPUT
        for prefill in prefills:
            first, count = prefill.send_range(1)
            prefill.send_chunk(room, first, np.arange(count, dtype=np.int32) + 3, 0)
        status = decode.wait(room, SUCCESS, 10.0)
        assert status[0] == SUCCESS, status
        for prefill in prefills:
            assert prefill.wait(room, SUCCESS, 5.0)[0] == SUCCESS
        # Decode's page 2 holds prefill's bytes in every buffer.
        page_bytes = PAGE_SIZE * 2 * 8 * 2
        for buffer in decode_kv:
            assert set(buffer[2 * page_bytes:3 * page_bytes].tolist()) == {0x11}
    finally:
        for connector in prefills + [decode]:
            if connector is not None:
                connector.close()


def test_prefill_room_that_times_out_tells_the_decode_ranks_it_heard_from():
    """Prefill TP 1 -> decode TP 2: only decode rank 0 creates its receiver, so the prefill
    room never has both destinations and fails at its bootstrap timeout (3 s). Decode rank 0,
    whose destination prefill had, hears of it then, instead of waiting out its own waiting
    timeout (30 s)."""
    server = K.BootstrapServer()
    room = 9
    prefill = decode = None
    try:
        args, kv, aux = attention_pools(2, 0x22, room_in_aux_row=room)
        prefill = K.PrefillConnector(**args, bootstrap_address=server.address,
                                     start_bootstrap_server=False, bootstrap_timeout=3.0)
        dargs, dkv, daux = attention_pools(1, 0)
        decode = K.DecodeConnector(**dargs, tp_rank=0, tp_size=2, bootstrap_timeout=5.0,
                                   waiting_timeout=30.0)
        prefill.create_sender(room, 1)
        decode.create_receiver(room, server.address, np.array([1], np.int32), 0)
        assert decode.wait(room, WAITING_FOR_INPUT, 5.0)[0] == WAITING_FOR_INPUT
        start = time.monotonic()
        state, error = decode.wait(room, SUCCESS, 10.0)
        assert state == FAILED, (state, error)
        assert time.monotonic() - start < 12.0
        assert "bootstrap timeout" in str(error), error
    finally:
        for connector in (prefill, decode):
            if connector is not None:
                connector.close()


def test_bootstrap_server_close_lets_other_threads_run():
    """close() with a request half sent: the server waits for that connection's read timeout,
    and lets go of the GIL meanwhile, so other Python threads go on."""
    import socket
    import threading

    server = K.BootstrapServer()
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"GET /route HTTP/1.1\r\nHost: x\r\n")  # never finished
        time.sleep(0.2)
        ticks, stop = [], threading.Event()

        def tick():
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(0.005)

        ticker = threading.Thread(target=tick)
        ticker.start()
        time.sleep(0.05)
        start = time.monotonic()
        server.close()
        end = time.monotonic()
        server.close()  # idempotent
        stop.set()
        ticker.join()
    during = [t for t in ticks if start < t < end]
    assert end - start < 0.1 or len(during) >= (end - start) / 0.05, (end - start, len(during))


def test_bootstrap_server_close_from_two_threads_returns_once_stopped():
    """A second close() while the first is still waiting for a half-sent request returns only
    once the server has stopped (after the request's read timeout, over a second), not at once."""
    import socket
    import threading

    server = K.BootstrapServer()
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"GET /route HTTP/1.1\r\nHost: x\r\n")  # never finished
        time.sleep(0.2)
        first = threading.Thread(target=server.close)
        first.start()
        time.sleep(0.1)
        start = time.monotonic()
        server.close()
        second_took = time.monotonic() - start
        first.join()
    assert second_took > 0.5, second_took
