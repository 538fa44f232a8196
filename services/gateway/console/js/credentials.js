// The Credentials panel (#/credentials, #/credentials/<integration>): the organization's stored
// credentials, a form to add one from an integration's auth schema, an MCP server's registration,
// an OAuth2 integration's "Connect", delete and set-default.
//
// Secrets go from password inputs straight into the request body; the form is removed once saved,
// and the API never sends a secret back (the list shows metadata only).

import { h, isolate, notice, safeUrl, text } from "./dom.js";
import { isExpired } from "./questions.js";
import {
  busy,
  confirmButton,
  describe as describeError,
  endOfDay,
  field,
  fill,
  header,
  table,
  time,
  viewSignal,
} from "./kit.js";

const AUTH_NAMES = {
  api_key: "API key",
  bearer: "Bearer token",
  bearer_token: "Bearer token",
  oauth2: "OAuth2",
  custom: "Custom fields",
  mcp_server: "MCP server",
};

/** The words for an auth type (the SDK's or the stored name). */
function authName(type) {
  return AUTH_NAMES[type] || type;
}

/** The panel: `preset` (an integration's name, from #/credentials/<name>) opens the form on it. */
export function renderCredentials(root, ctx, preset) {
  const { signal, cleanup } = viewSignal();
  const status = h("div", { class: "status", "aria-live": "polite" });
  const formBox = h("div");
  const list = h("section", { class: "card", id: "credential-list" });
  const reload = () =>
    fill(
      list,
      () => ctx.api.get("/credentials", { limit: 500 }, signal),
      (page) => credentialTable(ctx, page, status, reload),
      signal,
    );
  const add = h("button", { type: "button", id: "add-credential" }, "Add credential");
  const mcp = h("button", { type: "button", class: "secondary", id: "add-mcp" }, "Add MCP server");
  const done = (text) => {
    formBox.replaceChildren();
    status.replaceChildren(notice("ok", text));
    reload();
  };
  add.addEventListener("click", () => formBox.replaceChildren(credentialForm(ctx, signal, null, done)));
  mcp.addEventListener("click", () => formBox.replaceChildren(mcpForm(ctx, signal, done)));
  root.append(
    header(
      "Credentials",
      "The secrets your organization's tools use. Secrets are encrypted and never shown again.",
      add,
      mcp,
    ),
    status,
    formBox,
    list,
  );
  if (preset) formBox.replaceChildren(credentialForm(ctx, signal, preset, done));
  reload();
  return cleanup;
}

/** The list of credentials with their delete and set-default buttons. */
function credentialTable(ctx, page, status, reload) {
  const rows = page.credentials.map((c) => {
    const meta = c.credentials_metadata || {};
    const named = c.display_name || c.integration_name;
    const act = (label, question, doneText, run) =>
      confirmButton(label, question, async () => {
        try {
          await run();
          status.replaceChildren(notice("ok", `${doneText}: `, text(named)));
          reload();
        } catch (error) {
          status.replaceChildren(notice("error", describeError(error)));
        }
      }, { danger: label === "Delete" });
    const id = encodeURIComponent(c.credential_id);
    return h(
      "tr",
      { dataset: { credentialId: c.credential_id } },
      h("td", {}, h("span", { class: "mono" }, text(c.integration_name))),
      h("td", { class: "cred-name" }, c.display_name ? text(c.display_name) : h("span", { class: "muted" }, "(no name)")),
      h("td", {}, authName(c.auth_type)),
      h(
        "td",
        {},
        c.is_default
          ? h("span", { class: "badge ok" }, "default")
          : act("Make default", "Use this one when a call names none?", "Made default", () =>
              ctx.api.post(`/credentials/${id}/set-default`),
            ),
        meta.needs_reconnect ? h("span", { class: "badge failed" }, "needs reconnect") : null,
      ),
      h("td", {}, time(c.created_at)),
      h(
        "td",
        {},
        time(c.expires_at),
        isExpired(c) ? [" ", h("span", { class: "badge expired" }, "expired")] : null,
      ),
      h(
        "td",
        {},
        act("Delete", "Delete this credential?", "Deleted", () => ctx.api.delete(`/credentials/${id}`)),
      ),
    );
  });
  const more = page.has_next ? h("p", { class: "hint" }, `Showing ${rows.length} of ${page.total}.`) : null;
  return [
    table(
      ["Integration", "Name", "Auth type", "Default", "Created", "Expires", ""],
      rows,
      "No credentials yet: add one, or connect an integration.",
    ),
    more,
  ];
}

/** The form for a new credential: pick an integration, then an auth type, then fill its fields. */
function credentialForm(ctx, signal, preset, done) {
  const picker = h("select", { name: "integration", required: true }, h("option", { value: "" }, "Loading…"));
  const schemaBox = h("div", { class: "schema" });
  const status = h("div", { class: "status" });
  const cancel = h("button", { type: "button", class: "secondary" }, "Cancel");
  const form = h(
    "form",
    { class: "card", id: "credential-form", autocomplete: "off" },
    h("div", { class: "row" }, h("h2", { class: "grow" }, "Add a credential"), cancel),
    field("Integration", picker),
    schemaBox,
    status,
  );
  cancel.addEventListener("click", () => form.remove());
  ctx.api
    .get("/integrations/tools", null, signal)
    .then((tools) => {
      const label = (t) => t.display_name || t.name;
      const sorted = [...tools].sort((a, b) => label(a).localeCompare(label(b)));
      picker.replaceChildren(
        h("option", { value: "" }, "Choose an integration…"),
        ...sorted.map((t) => h("option", { value: t.name }, `${isolate(t.display_name || t.name)} (${isolate(t.name)})`)),
      );
      if (preset && sorted.some((t) => t.name === preset)) {
        picker.value = preset;
        showSchemas(ctx, signal, preset, schemaBox, done);
      } else if (preset) {
        status.replaceChildren(
          notice("error", "There is no integration named “", text(preset), "” here: choose one above."),
        );
      }
    })
    .catch((error) => {
      if (!signal.aborted) status.replaceChildren(notice("error", describeError(error)));
    });
  picker.addEventListener("change", () => showSchemas(ctx, signal, picker.value, schemaBox, done));
  form.addEventListener("submit", (event) => event.preventDefault());
  return form;
}

/** Fill `box` with the auth types of integration `name` and the fields of the chosen one. */
function showSchemas(ctx, signal, name, box, done) {
  if (!name) {
    box.replaceChildren();
    return;
  }
  fill(
    box,
    () => ctx.api.get(`/integrations/tools/${encodeURIComponent(name)}`, null, signal),
    (detail) => {
      const schemas = detail.auth_schemas || [];
      if (!schemas.length) {
        return notice("info", `${isolate(detail.display_name || name)} needs no credential: it is ready to use.`);
      }
      const fieldsBox = h("div");
      const choice = h(
        "select",
        { name: "auth_type" },
        schemas.map((s, i) =>
          h("option", { value: String(i) }, `${isolate(s.display_name || s.auth_type)} (${authName(s.auth_type)})`),
        ),
      );
      const pick = () =>
        fieldsBox.replaceChildren(schemaFields(ctx, detail, schemas[Number(choice.value)], done));
      choice.addEventListener("change", pick);
      const preferred = schemas.findIndex((s) => s.auth_type !== "oauth2" || s.supports_modulex_oauth);
      choice.value = String(Math.max(preferred, 0));
      pick();
      return [field("Auth type", choice), fieldsBox];
    },
    signal,
  );
}

/** The inputs of one auth schema (secrets in password inputs) with save, or OAuth2's Connect. */
function schemaFields(ctx, detail, schema, done) {
  const inputs = schema.setup_environment_variables.map((v) => ({
    name: v.name,
    input: h("input", {
      type: v.sensitive ? "password" : "text",
      name: `auth_${v.name}`,
      required: v.required,
      autocomplete: v.sensitive ? "new-password" : "off",
      spellcheck: "false",
    }),
    v,
  }));
  const common = commonInputs();
  const status = h("div", { class: "status" });
  const save = h("button", { type: "button", class: "save" }, "Save credential");
  const parts = [
    schema.description ? h("p", { class: "hint" }, schema.description) : null,
    schema.setup_instructions.length
      ? h(
          "details",
          { class: "steps" },
          h("summary", {}, `How to get it (${schema.setup_instructions.length} steps)`),
          h("ol", { class: "hint" }, schema.setup_instructions.map((s) => h("li", {}, s))),
        )
      : null,
  ];
  if (schema.auth_type === "oauth2") {
    parts.push(oauthConnect(ctx, detail, common, status));
    parts.push(h("p", { class: "hint" }, "Or store a token you already have:"));
  }
  save.addEventListener("click", async () => {
    const missing = inputs
      .filter((i) => i.v.required && !i.input.value)
      .map((i) => i.v.display_name || i.name);
    if (missing.length) {
      status.replaceChildren(notice("error", `Fill in: ${missing.join(", ")}`));
      return;
    }
    const authData = {};
    for (const i of inputs) if (i.input.value) authData[i.name] = i.input.value;
    const body = {
      integration_name: detail.name,
      auth_type: schema.auth_type,
      auth_data: authData,
      ...common.values(),
    };
    const saved = await busy(save, status, () => ctx.api.post("/credentials", body));
    if (!saved) return; // refused: the fields stay for a correction
    for (const i of inputs) i.input.value = ""; // saved: the secret leaves the page
    done(`Saved ${isolate(saved.display_name || saved.integration_name)} (${authName(saved.auth_type)}).`);
  });
  return h(
    "div",
    { class: "auth-fields" },
    parts,
    inputs.map((i) =>
      field(i.v.display_name || i.name, i.input, i.v.description || (i.v.required ? "" : "optional")),
    ),
    common.nodes,
    h("div", { class: "row" }, save),
    status,
  );
}

/** The inputs every credential takes: a display name, an expiry and "make default". */
function commonInputs() {
  const name = h("input", { type: "text", name: "display_name", maxlength: "200" });
  const expires = h("input", { type: "date", name: "expires_at" });
  const makeDefault = h("input", { type: "checkbox", name: "make_default" });
  return {
    nodes: [
      h(
        "div",
        { class: "row top" },
        field("Display name", name, "optional: how this credential is listed"),
        field("Expires", expires, "optional: when the secret stops working"),
      ),
      h("label", { class: "check" }, makeDefault, " Make it the integration's default"),
    ],
    values() {
      const values = { make_default: makeDefault.checked };
      if (name.value.trim()) values.display_name = name.value.trim();
      const at = endOfDay(expires.value);
      if (at) values.expires_at = at;
      return values;
    },
  };
}

/** OAuth2's Connect: start the flow and open the authorization page in a new window (noopener). */
function oauthConnect(ctx, detail, common, status) {
  if (!detail.auth_schemas.some((s) => s.auth_type === "oauth2" && s.supports_modulex_oauth)) {
    return notice(
      "info",
      "This deployment has no OAuth app for this integration (the operator configures one).",
    );
  }
  const connect = h(
    "button",
    { type: "button", class: "connect" },
    `Connect ${isolate(detail.display_name || detail.name)}`,
  );
  connect.addEventListener("click", async () => {
    const { display_name, make_default } = common.values();
    const body = {
      integration_name: detail.name,
      redirect_uri: new URL("/credentials/oauth2/callback", window.location.origin).href,
      make_default,
    };
    if (display_name) body.display_name = display_name;
    const started = await busy(connect, status, () => ctx.api.post("/credentials/oauth2/initiate", body));
    if (!started) return;
    const url = safeUrl(started.authorization_url);
    if (!url) {
      status.replaceChildren(notice("error", "The authorization URL is not an http(s) URL."));
      return;
    }
    window.open(url, "_blank", "noopener,noreferrer");
    status.replaceChildren(
      notice(
        "info",
        "Finish signing in in the new window, then reload this page: the credential appears in the list.",
      ),
    );
  });
  return h("div", { class: "row" }, connect);
}

/** The form registering a Streamable HTTP MCP server (its header value is a secret). */
function mcpForm(ctx, signal, done) {
  const url = h("input", { type: "url", name: "server_url", required: true, placeholder: "https://…/mcp" });
  const name = h("input", { type: "text", name: "display_name", maxlength: "200" });
  const headerName = h("input", { type: "text", name: "header_name", placeholder: "Authorization" });
  const headerValue = h("input", { type: "password", name: "header_value", autocomplete: "new-password" });
  const status = h("div", { class: "status" });
  const save = h("button", { type: "submit" }, "Register server");
  const cancel = h("button", { type: "button", class: "secondary" }, "Cancel");
  const form = h(
    "form",
    { class: "card", id: "mcp-form", autocomplete: "off" },
    h("h2", {}, "Add an MCP server"),
    h(
      "p",
      { class: "hint" },
      "A Streamable HTTP server: its tools become the actions of an integration named mcp_<name>.",
    ),
    field("Server URL", url),
    field("Display name", name, "optional"),
    h(
      "div",
      { class: "row top" },
      field("Header", headerName, "optional"),
      field("Header value", headerValue, "a secret: never shown again"),
    ),
    h("div", { class: "row" }, save, cancel),
    status,
  );
  cancel.addEventListener("click", () => form.remove());
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const body = { server_url: url.value.trim() };
    if (name.value.trim()) body.display_name = name.value.trim();
    if (headerName.value.trim()) body.headers = { [headerName.value.trim()]: headerValue.value };
    const created = await busy(save, status, () => ctx.api.post("/credentials/mcp-server", body, signal));
    if (!created) return;
    headerValue.value = "";
    const found = created.discovery_error
      ? `registered, but its tools could not be listed: ${created.discovery_error}`
      : `${created.total_tools} tools found`;
    done(`MCP server ${isolate(created.integration_name)}: ${found}.`);
  });
  return form;
}
