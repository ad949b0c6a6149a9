// Docstrings of the connector bindings (connector.cc).
#pragma once

namespace kvferry::python {

inline constexpr const char* kGeometryFromHfConfigDoc =
    "geometry_from_hf_config(json_text, name='') -> dict\n\n"
    "The KV geometry of a Hugging Face config.json (kvferry::ParseHfConfig): the dict the "
    "connectors take as `geometry` (keys: name, attention ('mha'/'mla'), num_layers, "
    "num_attention_heads, num_kv_heads, head_dim, kv_lora_rank, qk_rope_head_dim, "
    "hidden_size, dtype, and the linear-attention fields of hybrid models). Whole-model "
    "numbers: a TP rank's pool holds num_kv_heads / tp_size heads. Raises "
    "kvferry.InvalidArgumentError naming a missing or invalid field.";

inline constexpr const char* kBootstrapServerDoc =
    "BootstrapServer(host='127.0.0.1', port=0, *, auth_secret='', insecure=False)\n\n"
    "The prefill instance's bootstrap HTTP server (kvferry/bootstrap.h): prefill ranks register "
    "there, decode ranks look them up. Serves from its own threads until close() or until the "
    "object is collected. port 0 picks a free port (read `address` back). A non-loopback host "
    "needs auth_secret (>= 16 bytes; default KVFERRY_AUTH_TOKEN) or insecure=True. Raises "
    "kvferry.UnavailableError when the address cannot be bound.";

inline constexpr const char* kPrefillDoc =
    "PrefillConnector(*, geometry, page_size, num_pages, kv_bases, aux_field_bytes, aux_bases, "
    "num_aux_rows, aux_room_field=-1, state_bases=[], num_state_slots=0, device=None, "
    "aux_device=None, bootstrap_address='127.0.0.1:0', start_bootstrap_server=False, tp_rank=0, "
    "tp_size=1, cp_rank=0, cp_size=1, pp_rank=0, total_kv_heads=0, engine=None, "
    "bootstrap_timeout=60.0, transfer_timeout=60.0, heartbeat_timeout=30.0, allow_pull=False)\n\n"
    "A prefill rank's connector (kvferry::PrefillConnector) over buffers the caller owns:\n"
    "- kv_bases: one address per layer buffer (K of every layer, then V of every layer; MLA: "
    "one latent per layer), each num_pages pages of page_size tokens x this rank's KV heads x "
    "head_dim elements of geometry['dtype'], laid out [page][token][head][head_dim];\n"
    "- aux_bases / aux_field_bytes: one address and row size in bytes per aux field, each "
    "num_aux_rows rows; the uint64 at offset 0 of field aux_room_field (-1: the last) holds "
    "the row's bootstrap room;\n"
    "- state_bases: hybrid models' state buffers (conv state of each linear layer, then "
    "recurrent state of each), num_state_slots slots each;\n"
    "- device: None for host memory, else the CUDA ordinal of the KV and state buffers; "
    "aux_device likewise for the aux fields (SGLang keeps them in host memory).\n"
    "geometry is a dict as geometry_from_hf_config returns, with num_kv_heads = this rank's "
    "heads. kvferry registers the buffers with its engine and never frees them: keep them "
    "alive until close(). engine: a dict of TransferEngine options (name, listen_host, "
    "listen_port, transport, default_deadline, connect_timeout, auth_secret, insecure, "
    "tcp_lanes_per_peer, faults). Timeouts in seconds. Registers this rank with the bootstrap "
    "server at bootstrap_address (start_bootstrap_server=True runs one). Blocks while the "
    "engine starts. allow_pull=True registers the buffers for remote reads, so that decode "
    "ranks created with pull=True READ their KV from here (any peer that passed the engine's "
    "handshake may then read them). Raises kvferry.InvalidArgumentError for buffers or a "
    "geometry that do not fit, and the engine's and bootstrap server's errors.";

inline constexpr const char* kDecodeDoc =
    "DecodeConnector(*, geometry, page_size, num_pages, kv_bases, aux_field_bytes, aux_bases, "
    "num_aux_rows, aux_room_field=-1, state_bases=[], num_state_slots=0, device=None, "
    "aux_device=None, tp_rank=0, tp_size=1, engine=None, kv_path='auto', staging_bytes=1<<30, "
    "bootstrap_timeout=30.0, waiting_timeout=60.0, heartbeat_interval=2.0, pull=False)\n\n"
    "A decode rank's connector (kvferry::DecodeConnector) over buffers the caller owns; the "
    "buffer arguments are as PrefillConnector's. kv_path chooses how unequal TP moves head "
    "slices: 'direct', 'staging', 'fused', 'auto'. "
    "staging_bytes: the staging ring, allocated by kvferry when first needed. pull=True: this "
    "rank READs each batch from prefill ranks created with allow_pull=True (over NVLink, or "
    "slices of whole tokens; the copy kernels then run on this rank's GPU: for prefill ranks "
    "that share a GPU without MPS); others still write. Timeouts in seconds. Raises as "
    "PrefillConnector.";

inline constexpr const char* kCreateSenderDoc =
    "create_sender(room, num_pages, state_slot=-1)\n\n"
    "Starts a room for a request of num_pages pages (state_slot: its linear-attention state "
    "slot, -1 without). Does not block. Raises kvferry.AlreadyExistsError for a duplicate room, "
    "InvalidArgumentError / OutOfRangeError for bad counts or slots.";

inline constexpr const char* kSendChunkDoc =
    "send_chunk(room, first_page, pages, aux_row=None)\n\n"
    "Sends the request's pages [first_page, first_page + len(pages)) from this rank's pool "
    "pages `pages` (int32 array, token order). The last chunk passes aux_row and completes "
    "the pages this rank sends (send_range). Does not block on the network. Raises "
    "kvferry.FailedPreconditionError unless the room is WaitingForInput or Transferring (the "
    "room's failure when it failed), InvalidArgumentError / OutOfRangeError for pages.";

inline constexpr const char* kPendingDestinationsDoc =
    "pending_destinations(room) -> int\n\n"
    "How many decode ranks sent their destination for a room create_sender has not opened "
    "yet (kept for bootstrap_timeout); 0 once it is open. Never blocks.";

inline constexpr const char* kSendRangeDoc =
    "send_range(num_pages) -> (first_page, num_pages)\n\n"
    "The pages of a request of num_pages pages that this rank sends (all of them without "
    "context parallelism).";

inline constexpr const char* kBeginLayerwisePassDoc =
    "begin_layerwise_pass(chunks) -> int\n\n"
    "Registers the chunks of one forward pass, each a tuple (room, first_page, pages, aux_row "
    "or None), with send_chunk's checks, but moves nothing until mark_layer_ready says a layer "
    "ran. Returns the pass id. Does not block on the network. Raises as send_chunk.";

inline constexpr const char* kMarkLayerReadyDoc =
    "mark_layer_ready(pass_id, layer, cuda_event=None)\n\n"
    "Model layer `layer` of the pass wrote its KV; it leaves once layers 0..layer are all "
    "marked. cuda_event: the address of a cudaEvent_t recorded after the layer (e.g. "
    "torch.cuda.Event().cuda_event): the layer leaves once the event completed, and the "
    "caller does not wait. Never blocks on the network. Raises kvferry.NotFoundError (unknown "
    "pass), OutOfRangeError (layer), AlreadyExistsError (marked twice).";

inline constexpr const char* kCreateReceiverDoc =
    "create_receiver(room, bootstrap_address, pages, aux_row, state_slot=-1)\n\n"
    "Starts receiving a request into this rank's pool pages `pages` (int32 array, token "
    "order), aux row aux_row and state slot state_slot; bootstrapping with the prefill "
    "instance at bootstrap_address ('host:port') runs in the background. Raises "
    "kvferry.AlreadyExistsError for a duplicate room, InvalidArgumentError / OutOfRangeError "
    "for pages, row or slot.";

inline constexpr const char* kPollDoc =
    "poll(room) -> (state, error)\n\n"
    "The room's state (0 Bootstrapping, 1 WaitingForInput, 2 Transferring, 3 Success, 4 "
    "Failed) and, when Failed, its error (a kvferry.Error instance; else None). Never blocks. "
    "Raises kvferry.NotFoundError for an unknown room.";

inline constexpr const char* kWaitDoc =
    "wait(room, state, timeout) -> (state, error)\n\n"
    "Blocks (without the GIL, in slices of 50 ms between which a Ctrl-C on the main thread "
    "is noticed) until the room reaches `state` or later, fails, or timeout seconds (> 0) "
    "pass; returns as poll. Raises kvferry.NotFoundError, kvferry.InvalidArgumentError for a "
    "timeout that is not positive, and kvferry.FailedPreconditionError once close() began.";

inline constexpr const char* kAbortDoc =
    "abort(room, reason='aborted by the caller')\n\n"
    "Fails the room and tells the other side. Raises kvferry.NotFoundError.";

inline constexpr const char* kReleaseDoc =
    "release(room)\n\n"
    "Forgets a final room. Raises kvferry.NotFoundError, FailedPreconditionError (not final).";

inline constexpr const char* kStatsDoc =
    "stats() -> dict\n\n"
    "Counters since creation: transfer_requests, bytes, rooms_succeeded, rooms_failed, "
    "rooms_failed_by_code (status code name -> count), rooms_done_by_mailbox, "
    "control_messages_refused. Never blocks.";

inline constexpr const char* kEngineMetricsDoc =
    "engine_metrics() -> dict\n\nThe connector's transfer engine counters, as "
    "TransferEngine.metrics().";

inline constexpr const char* kCloseDoc =
    "close()\n\n"
    "Stops the connector and its engine (rooms still open fail) and lets go of the wrapped "
    "buffers; waits for calls in progress (a wait() in progress ends within 50 ms, raising "
    "kvferry.FailedPreconditionError). Idempotent; later calls raise "
    "kvferry.FailedPreconditionError.";

}  // namespace kvferry::python
