"""`python -m services.tools` serves the tools service; `python -m services.tools migrate` upgrades
its database.

Other sub-commands:
  `python -m services.tools generate-key` prints a new Fernet key for LOOPLINE_TOOLS_CREDENTIAL_KEY.
  `python -m services.tools rotate-credentials` encrypts every stored secret again with the first
  key of LOOPLINE_TOOLS_CREDENTIAL_KEY (after NEW,OLD is configured; then OLD can be dropped);
  a secret the first key already decrypts is skipped, so a second run rewrites nothing.
  `python -m services.tools reembed [--knowledge-base ID ...] [--all]` embeds knowledge again
  after its model changed (reembed.py) and prints JSON.
"""

from __future__ import annotations

from services.common import early_signals  # noqa: F401 - first: a SIGTERM during the imports below stops the server gracefully

# isort: split
import argparse
import asyncio
import json
import sys

from services.common import db
from services.common.runner import run
from services.tools.config import ToolsSettings


async def rotate_credentials(settings: ToolsSettings) -> tuple[int, dict]:
    """`rotate-credentials`: (exit code, JSON document) — `{"rotated": N, "undecryptable": [ids],
    "oauth2_flows_rotated": M}` (credentials rewritten, those no configured key decrypts: exit 1,
    pending OAuth2 flows rewritten; rows already under the first key are skipped), or
    `{"error": ...}` (exit 1) when no key is set, a key is malformed, the SQLite database
    does not exist (it is never created here) or the database cannot be used (a malformed URL,
    a file that is not the tools database, a server that refuses: `db.unusable_database`,
    naming the file or server, never the URL's password; README "Administration from the
    command line")."""
    if settings.uses_dev_credential_key():
        return 1, {
            "error": "LOOPLINE_TOOLS_CREDENTIAL_KEY is not set: set it to NEW,OLD (the new key "
            "first) and run again"
        }
    url = settings.database_url()
    try:
        return await _rotate(settings, url)
    except Exception as error:  # a database that cannot be used: named, never the URL's password
        problem = db.unusable_database(error, url, "tools", "LOOPLINE_TOOLS_DATABASE_URL")
        if problem is None:
            raise
        return 1, {"error": problem}


async def _rotate(settings: ToolsSettings, url: str) -> tuple[int, dict]:
    """`rotate_credentials` once a key is set, without its answer to an unusable database."""
    db.check_sqlite_file(url)  # first: a folder that is a file is said as such
    missing = db.missing_sqlite_file(url)
    if missing is not None:
        return 1, {
            "error": f"no tools database at {missing}: run with the services' LOOPLINE_DATA_DIR or "
            "database URL"
        }
    from services.tools.catalogue import Catalogue
    from services.tools.credentials import CredentialStore
    from services.tools.crypto import SecretBox

    try:
        box = SecretBox(settings.credential_keys())
    except ValueError as malformed:  # the message names the rule, never the key
        return 1, {"error": f"LOOPLINE_TOOLS_CREDENTIAL_KEY: {malformed}"}
    engine = db.make_engine(url, timeout_s=settings.db_timeout_s)
    try:
        store = CredentialStore(db.sessionmaker(engine), box, Catalogue([]))
        rotated, undecryptable, flows = await store.rotate_secrets()
    finally:
        await engine.dispose()
    return (1 if undecryptable else 0), {
        "rotated": rotated,
        "undecryptable": undecryptable,
        "oauth2_flows_rotated": flows,
    }


async def reembed_command(settings: ToolsSettings, args: argparse.Namespace) -> tuple[int, dict]:
    """`reembed`: (exit code, JSON document); the embedders read credentials as the service does."""
    from services.tools.catalogue import Catalogue
    from services.tools.credentials import CredentialStore
    from services.tools.crypto import SecretBox
    from services.tools.embedder_source import Embedders
    from services.tools.knowledge import KnowledgeStore
    from services.tools.knowledge_indexer import EmbeddingSpec
    from services.tools.reembed import reembed

    url = settings.database_url()
    missing = db.missing_sqlite_file(url)
    if missing is not None:
        return 1, {"error": f"no tools database at {missing}"}
    spec = None
    if args.provider == "local":
        spec = EmbeddingSpec()
    elif args.provider == "openai":
        if not (args.model and args.credential_id):
            return 1, {"error": "--provider openai needs --model and --credential-id"}
        spec = EmbeddingSpec(args.provider, args.model, args.dimensions, args.credential_id)
    engine = db.make_engine(url, timeout_s=settings.db_timeout_s)
    sessions = db.sessionmaker(engine)
    credentials = CredentialStore(sessions, SecretBox(settings.credential_keys()), Catalogue([]))
    embedders = Embedders(credentials, settings.embedding_openai_base_url, settings.tools_timeout_s)
    store = KnowledgeStore(engine, sessions, embedders)
    try:
        document = await reembed(store, sessions, args.knowledge_base, args.all, spec, credentials)
    finally:
        await store.close()
        await engine.dispose()
    return (1 if "error" in document or document["failed"] else 0), document


REEMBED_INTERRUPTED = (
    "interrupted: the documents it reopened stay processing, and the tools service embeds them"
)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen command; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m services.tools", description="Loopline tools service"
    )
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="serve gRPC (the default)")
    sub.add_parser("migrate", help="upgrade the database to the newest migration")
    sub.add_parser("generate-key", help="print a new Fernet key for LOOPLINE_TOOLS_CREDENTIAL_KEY")
    sub.add_parser(
        "rotate-credentials",
        help="encrypt every stored secret again with the first configured key (prints JSON)",
    )
    again = sub.add_parser(
        "reembed", help="embed knowledge again after its model changed (prints JSON)"
    )
    again.add_argument("--knowledge-base", action="append", default=[], metavar="ID")
    again.add_argument("--all", action="store_true", help="drop every vector first")
    again.add_argument(
        "--provider", choices=["local", "openai"], help="switch the knowledge bases to this model"
    )
    again.add_argument("--model", default="", help="the openai model's name")
    again.add_argument("--dimensions", type=int, default=0)
    again.add_argument("--credential-id", default="")
    args = parser.parse_args(argv)
    settings = ToolsSettings()
    if args.command == "migrate":
        return db.migrate_command("tools", settings.database_url())
    if args.command == "generate-key":
        from cryptography.fernet import Fernet

        print(Fernet.generate_key().decode())
        return 0

    if args.command == "rotate-credentials":
        code, document = asyncio.run(rotate_credentials(settings))
        print(json.dumps(document))
        return code

    if args.command == "reembed":
        try:
            code, document = asyncio.run(reembed_command(settings, args))
        except KeyboardInterrupt:  # Ctrl-C: still one JSON document, as on any other end
            code, document = 130, {"error": REEMBED_INTERRUPTED}
        print(json.dumps(document))
        return code

    from services.tools.server import ToolsServer

    run("tools", settings.log_level, lambda: ToolsServer.start(settings), settings.shutdown_grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
