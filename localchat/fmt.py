"""Small formatting helpers shared by the CLI and the app."""


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KB'; bytes below 1 KB stay whole."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
