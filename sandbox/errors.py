"""Refusals the sandbox answers with: an HTTP status, a stable machine code and a sentence."""


class SandboxError(Exception):
    status = 400
    code = "invalid_request"

    def __init__(self, detail: str, *, status: int | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(detail)
        self.detail = detail
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def as_body(self) -> dict:
        return {"detail": self.detail, "code": self.code, "status": self.status}


class InvalidArgument(SandboxError):
    status = 400
    code = "invalid_argument"


class NotFound(SandboxError):
    status = 404
    code = "not_found"


class Conflict(SandboxError):
    status = 409
    code = "conflict"


class IdempotencyKeyReused(SandboxError):
    status = 422
    code = "idempotency_key_reused"


class NotAuthenticated(SandboxError):
    status = 401
    code = "not_authenticated"


class Forbidden(SandboxError):
    status = 403
    code = "permission_denied"
