"""Settings of the gRPC transport (servers and clients)."""

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RetryConfig(BaseModel):
    """Client retries: exponential backoff on UNAVAILABLE and other transient stream failures."""

    model_config = ConfigDict(extra="forbid")

    max_attempts: int = Field(8, ge=1, description="streams opened per send() before giving up")
    initial_backoff_s: float = Field(0.05, gt=0, description="wait before the first retry")
    max_backoff_s: float = Field(2.0, gt=0, description="cap of the doubling backoff")

    @model_validator(mode="after")
    def _backoff_order(self):
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"retry.max_backoff_s={self.max_backoff_s} is below retry.initial_backoff_s={self.initial_backoff_s}; "
                "raise max_backoff_s or lower initial_backoff_s"
            )
        return self


class TransportConfig(BaseModel):
    """Trajectory/monitor/control endpoints. Defaults suit one trainer host; see docs/grpc_api.md."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="bind address of servers (0.0.0.0 to serve other hosts)")
    port: int = Field(50051, ge=0, le=65535, description="listen port; 0 picks a free one")
    queue_capacity: int = Field(1024, ge=1, description="messages buffered server-side before senders wait")
    stream_window: int = Field(32, ge=1, description="unacknowledged messages a client may have in flight per stream")
    dedupe_window: int = Field(200_000, ge=1, description="most recent accepted ids remembered to detect resends")
    vocab_size: int | None = Field(None, ge=1, description="when set, token ids must lie in [0, vocab_size)")
    max_sample_tokens: int = Field(131_072, ge=1, description="longest prompt or response accepted, in tokens")
    max_top_k: int = Field(64, ge=0, description="largest top-k width accepted")
    max_message_mb: int = Field(64, ge=1, description="gRPC message size limit (a 38K-token sample with top-20 is ~5 MB)")
    max_workers: int = Field(16, ge=2, description="server threads; each open stream holds one")
    retry: RetryConfig = Field(default_factory=RetryConfig)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def grpc_options(self) -> list[tuple[str, int]]:
        size = self.max_message_mb * 1024 * 1024
        return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]
