#!/usr/bin/env python3
"""Copies one of etcd's .proto files, stripped so that a plain protoc builds it.

etcd's protos use gogoproto options (Go code generation only) and
google.api.http annotations (the grpc-gateway), neither of which Debian's
protoc has. This removes their imports, file options, field options and
the option blocks inside rpc definitions, and points the imports of etcd's
own protos at the copies' paths (etcd/<dir>/<file>.proto, the layout that
ha/CMakeLists.txt writes).

Usage: strip_etcd_proto.py IN.proto OUT.proto
"""
import re
import sys

# etcd's import paths of its own protos -> where the copies are.
IMPORTS = {
    "etcd/mvcc/mvccpb/kv.proto": "etcd/mvcc/mvccpb/kv.proto",
    "etcd/auth/authpb/auth.proto": "etcd/auth/authpb/auth.proto",
    "mvcc/mvccpb/kv.proto": "etcd/mvcc/mvccpb/kv.proto",
    "auth/authpb/auth.proto": "etcd/auth/authpb/auth.proto",
    "go.etcd.io/etcd/mvcc/mvccpb/kv.proto": "etcd/mvcc/mvccpb/kv.proto",
    "go.etcd.io/etcd/auth/authpb/auth.proto": "etcd/auth/authpb/auth.proto",
}


def strip_blocks(text, start):
    """Removes each match of start (ending in "{") up to its matching "}"
    and an optional ";" after it."""
    out = []
    pos = 0
    while True:
        m = start.search(text, pos)
        if not m:
            out.append(text[pos:])
            return "".join(out)
        out.append(text[pos:m.start()])
        depth = 1
        i = m.end()
        while depth > 0:
            if i >= len(text):
                sys.exit("strip_etcd_proto.py: unbalanced braces")
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        m2 = re.match(r'\s*;', text[i:])
        pos = i + (m2.end() if m2 else 0)


def strip(text):
    # Imports of the option definitions.
    text = re.sub(r'^\s*import\s+"gogoproto/gogo\.proto"\s*;[^\n]*\n', "",
                  text, flags=re.M)
    text = re.sub(r'^\s*import\s+"google/api/annotations\.proto"\s*;[^\n]*\n',
                  "", text, flags=re.M)
    # File and message options: option (gogoproto.x) = y;
    text = re.sub(r'^\s*option\s*\(gogoproto\.[A-Za-z0-9_]+\)\s*=[^;]*;[^\n]*\n',
                  "", text, flags=re.M)
    # The grpc-gateway blocks inside rpc definitions: option (google.api.http)
    # = { post: "..." body: "*" additional_bindings { ... } }; braces nest.
    text = strip_blocks(text, re.compile(
        r'\s*option\s*\(google\.api\.http\)\s*=\s*\{'))
    # Field options: [(gogoproto.x) = y, (gogoproto.z) = w] and gogoproto
    # items mixed with others.
    def field_options(m):
        items = [i.strip() for i in m.group(1).split(",")]
        kept = [i for i in items if i and not i.startswith("(gogoproto.")]
        return " [" + ", ".join(kept) + "]" if kept else ""
    text = re.sub(r'\s*\[([^\[\]]*\(gogoproto\.[^\[\]]*)\]', field_options, text)
    # Imports of etcd's own protos.
    def fix_import(m):
        return 'import "%s";' % IMPORTS.get(m.group(1), m.group(1))
    text = re.sub(r'import\s+"([^"]+)"\s*;', fix_import, text)
    if "gogoproto" in text or "google.api" in text:
        leftover = [l for l in text.splitlines()
                    if "gogoproto" in l or "google.api" in l]
        sys.exit("strip_etcd_proto.py: options left after stripping:\n" +
                 "\n".join(leftover))
    return text


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1], encoding="utf-8") as f:
        text = strip(f.read())
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
