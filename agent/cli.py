def main(argv=None) -> int:
    raise SystemExit("not yet")
