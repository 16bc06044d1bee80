"""Who is calling: the frozen AuthContext every request carries after the one auth step."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCOPES", "ROLE_SCOPES", "AuthContext"]

#: The scopes a credential can hold. ``admin`` implies ``read`` and ``write``.
SCOPES = ("read", "write", "admin")

#: What an Access member's role grants.
ROLE_SCOPES: dict[str, frozenset[str]] = {
    "owner": frozenset(SCOPES),
    "admin": frozenset(SCOPES),
    "member": frozenset({"read", "write"}),
    "viewer": frozenset({"read"}),
}


@dataclass(frozen=True, slots=True)
class AuthContext:
    org_id: str
    org_slug: str
    #: ``key:<id>``, ``user:<email>`` or ``service:<common_name>``.
    principal: str
    scopes: frozenset[str]
    key_id: str | None = None

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes
