// The Knowledge panel (#/knowledge, #/knowledge/<base id>): the organization's knowledge bases,
// creating one, uploading a document into one and searching it.
//
// Loopline has no route that lists a base's documents: the documents uploaded in this visit are
// listed, and the base's document and chunk counts come from the list of bases.

import { ApiError } from "./api.js";
import { h, isolate, notice, plural, text } from "./dom.js";
import { busy, field, fill, header, table, time, viewSignal } from "./kit.js";

// The upload route's limit and the types it indexes (docs/credentials-and-mcp.md).
const MAX_UPLOAD_BYTES = 10 * 1024 * 1024;
const TYPES = ".txt,.md,.html,.htm,.csv,.json,.pdf,text/*,application/json,application/pdf";

/** The panel: the list of bases, or one base (`id`) with its upload and search forms. */
export function renderKnowledge(root, ctx, id) {
  const { signal, cleanup } = viewSignal();
  if (id) renderBase(root, ctx, id, signal);
  else renderBases(root, ctx, signal);
  return cleanup;
}

function renderBases(root, ctx, signal) {
  const list = h("section", { class: "card", id: "knowledge-list" });
  const status = h("div", { class: "status", "aria-live": "polite" });
  const reload = () =>
    fill(list, () => ctx.api.get("/knowledge-bases", { limit: 500 }, signal), basesTable, signal);
  root.append(
    header("Knowledge", "Documents the assistant can search, by meaning and keywords, with its knowledge tool."),
    createForm(ctx, signal, status, (kb) => ctx.navigate(`#/knowledge/${encodeURIComponent(kb.id)}`)),
    status,
    list,
  );
  reload();
}

function basesTable(bases) {
  return table(
    ["Name", "Description", "Documents", "Chunks", "Created"],
    bases.map((kb) =>
      h(
        "tr",
        { dataset: { knowledgeBaseId: kb.id } },
        h("td", {}, h("a", { href: `#/knowledge/${encodeURIComponent(kb.id)}`, class: "kb-link" }, text(kb.name))),
        h("td", { class: "muted" }, text(kb.description || "")),
        h("td", {}, String(kb.document_count)),
        h("td", {}, String(kb.total_chunks)),
        h("td", {}, time(kb.created_at)),
      ),
    ),
    "No knowledge bases yet: create one above.",
  );
}

/** The "new knowledge base" form; `created(kb)` runs with the new base. */
function createForm(ctx, signal, status, created) {
  const name = h("input", { type: "text", name: "kb_name", required: true, maxlength: "200" });
  const description = h("input", { type: "text", name: "kb_description", maxlength: "10000" });
  const save = h("button", { type: "submit" }, "Create");
  const form = h(
    "form",
    { class: "card", id: "knowledge-create" },
    h("h2", {}, "New knowledge base"),
    h(
      "div",
      { class: "row top" },
      h("div", { class: "grow" }, field("Name", name)),
      h("div", { class: "grow" }, field("Description", description, "optional")),
    ),
    save,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = { name: name.value.trim() };
    if (description.value.trim()) body.description = description.value.trim();
    const kb = await busy(save, status, () => ctx.api.post("/knowledge-bases", body, signal));
    if (kb) created(kb);
  });
  return form;
}

/** One base: its facts, the upload form, the documents uploaded now and the search. */
function renderBase(root, ctx, id, signal) {
  const facts = h("div", { class: "kb-facts" });
  root.append(h("p", {}, h("a", { href: "#/knowledge" }, "← All knowledge bases")), facts);
  const load = () =>
    fill(
      facts,
      async () => {
        const bases = await ctx.api.get("/knowledge-bases", { limit: 500 }, signal);
        const kb = bases.find((b) => b.id === id);
        if (!kb) throw new ApiError(404, "Knowledge base not found");
        return kb;
      },
      (kb) =>
        header(
          text(kb.name),
          kb.description ? text(kb.description) : null,
          h(
            "span",
            { class: "muted counts" },
            `${plural(kb.document_count, "document")}, ${plural(kb.total_chunks, "chunk")}`,
          ),
        ),
      signal,
    );
  load().then(() => {
    if (!facts.querySelector("h1")) return; // refused or missing: the notice is shown
    root.append(uploadCard(ctx, id, signal, load), searchCard(ctx, id, signal));
  });
}

/** The upload form (multipart `file`) and the list of documents uploaded in this visit. */
function uploadCard(ctx, id, signal, uploadedOne) {
  const file = h("input", { type: "file", name: "file", accept: TYPES, required: true });
  const send = h("button", { type: "submit" }, "Upload");
  const status = h("div", { class: "status", "aria-live": "polite" });
  const uploaded = [];
  const list = h("div", { id: "documents" });
  const form = h(
    "form",
    { class: "card", id: "knowledge-upload" },
    h("h2", {}, "Upload a document"),
    h("p", { class: "hint" }, "txt, md, html, csv, json or pdf, up to 10 MiB; found by its words at once, by meaning once embedded."),
    h("div", { class: "row" }, file, send),
    status,
    list,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const chosen = file.files[0];
    if (!chosen) return;
    if (chosen.size > MAX_UPLOAD_BYTES) {
      status.replaceChildren(notice("error", `${isolate(chosen.name)} is over 10 MiB: the server refuses it (413).`));
      return;
    }
    const data = new FormData();
    data.append("file", chosen, chosen.name);
    const path = `/knowledge-bases/${encodeURIComponent(id)}/documents`;
    const doc = await busy(send, status, () => ctx.api.request("POST", path, { form: data, signal }));
    if (!doc) return;
    form.reset();
    status.replaceChildren(
      notice(
        "ok",
        "Indexed ",
        text(doc.filename),
        `: ${plural(doc.chunk_count, "chunk")}${doc.status === "processing" ? EMBEDDING : ""}.`,
      ),
    );
    uploadedOne();
    uploaded.unshift(doc);
    list.replaceChildren(documentsTable(uploaded));
  });
  return form;
}

function documentsTable(docs) {
  return h(
    "div",
    {},
    h("h3", {}, "Uploaded now"),
    table(
      ["File", "Type", "Size", "Status", "Chunks", "Uploaded"],
      docs.map((d) => [
        text(d.filename),
        d.file_type,
        bytes(d.file_size_bytes),
        d.status,
        String(d.chunk_count),
        time(d.created_at),
      ]),
      "",
    ),
  );
}

// Said of an upload still being embedded: keyword search finds it already.
const EMBEDDING = ", found by its words now and by meaning once embedded (seconds a page)";

/** The search form and its matches (score, file, chunk, the matching text). */
function searchCard(ctx, id, signal) {
  const query = h("input", { type: "search", name: "query", required: true, placeholder: "Words to find" });
  const topK = h("input", {
    type: "number",
    name: "top_k",
    min: "1",
    max: "50",
    value: "5",
    class: "narrow",
  });
  const go = h("button", { type: "submit" }, "Search");
  const results = h("div", { id: "search-results", "aria-live": "polite" });
  const form = h(
    "form",
    { class: "card", id: "knowledge-search" },
    h("h2", {}, "Search"),
    h(
      "div",
      { class: "row top" },
      h("div", { class: "grow" }, field("Query", query)),
      field("Results", topK),
    ),
    go,
    results,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = { query: query.value, top_k: Number(topK.value) || 5 };
    const path = `/knowledge-bases/${encodeURIComponent(id)}/hybrid-search`;
    const found = await busy(go, results, () => ctx.api.post(path, body, signal));
    if (found) results.replaceChildren(matches(found));
  });
  return form;
}

function matches(found) {
  if (!found.matches.length) return h("p", { class: "muted empty" }, "Nothing matches “", text(found.query), "”.");
  return h(
    "ol",
    { class: "matches" },
    found.matches.map((m) =>
      h(
        "li",
        { class: "match" },
        h(
          "div",
          { class: "row" },
          h("strong", {}, text(m.document_filename)),
          h("span", { class: "muted" }, `chunk ${m.chunk_index}`),
          h(
            "span",
            {
              class: "badge",
              title: "0 to 1: 0.7 × meaning + 0.3 × share of the query's words found",
            },
            `score ${formatScore(m.score)}`,
          ),
          h(
            "span",
            { class: "muted" },
            `meaning ${formatScore(m.semantic_score)} · words ${formatScore(m.keyword_score)}`,
          ),
        ),
        h("pre", { class: "match-text" }, m.content ?? ""),
      ),
    ),
  );
}

function formatScore(score) {
  return typeof score === "number" ? String(Number(score.toPrecision(3))) : String(score);
}

function bytes(n) {
  if (typeof n !== "number") return "";
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}
