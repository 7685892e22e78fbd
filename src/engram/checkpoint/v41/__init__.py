"""The V4.1 checkpoint format for Engram modules: safetensors shards + config.json, no pickle.

`format` holds the format itself (file and tensor names, shard metadata, which tensors a config
expects and the layout fingerprint rule), `writer` writes it atomically (`save_checkpoint`), `reader`
checks every tensor and fingerprint before it builds modules (`load_engram_modules`, `stored_tables`).
Each shard we write records the layout fingerprint (and each quantised table's content fingerprint and,
beside FP8, its row format), so tables are never loaded under another layout, and the CRC32 of every
tensor under a seal, so a byte damaged after the write is refused; DeepSeek's files record none and
load as they are.
Conversions are `engram.checkpoint.convert`'s. Design: docs/checkpoint.md.
"""

from engram.checkpoint.v41.format import (
    BASE_MODEL_KEY,
    CONFIG_FILE,
    CRC32_KEY,
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    LAYOUT_FINGERPRINT_KEY,
    SEAL_KEY,
    TABLE_FINGERPRINT_KEY,
    TABLE_FORMAT_KEY,
    TableFormat,
    crc32_entry,
    foreign_config,
    is_row_file_name,
    is_shard_name,
    layer_prefix,
    row_file_name,
    seal_of,
)
from engram.checkpoint.v41.reader import (
    StoredTable,
    load_engram_modules,
    read_checkpoint_config,
    recorded_metadata,
    stored_tables,
)
from engram.checkpoint.v41.writer import engram_state_dict, save_checkpoint

__all__ = [
    "BASE_MODEL_KEY",
    "CONFIG_FILE",
    "CRC32_KEY",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "LAYOUT_FINGERPRINT_KEY",
    "SEAL_KEY",
    "TABLE_FINGERPRINT_KEY",
    "TABLE_FORMAT_KEY",
    "StoredTable",
    "TableFormat",
    "crc32_entry",
    "engram_state_dict",
    "foreign_config",
    "is_row_file_name",
    "is_shard_name",
    "layer_prefix",
    "load_engram_modules",
    "read_checkpoint_config",
    "recorded_metadata",
    "row_file_name",
    "save_checkpoint",
    "seal_of",
    "stored_tables",
]
