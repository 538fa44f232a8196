// A paused run's question as a form, answered with POST /assistant/chat/{id}/resume.
//
// One form per kind (single_choice, multi_choice, yes_no, free_text, credential_request), each
// with "Skip" ({"kind": "skipped"}). The answer shapes are the SDK's UserInputResponse
// (docs/http-api.md "Answering a question"); the server checks them again, and its refusal
// (`detail`) is shown under the form, which stays open.

import { ApiError } from "./api.js";
import { h, isolate, notice, plural, safeUrl, text } from "./dom.js";

let formCount = 0;

/** The text of a failed request for a notice. */
function failure(error) {
  return error instanceof ApiError
    ? `${error.status}: ${error.detail}`
    : "The gateway cannot be reached.";
}

/** A form for `request`. hooks.onAnswered(started, summary) gets the resume's answer
 * ({run_id, stream_url, ...}) and a one-line text of what was answered; hooks.onConflict() runs
 * on a 409 (answered in another tab, or the run is no longer paused). */
export function questionForm(api, chatId, request, { onAnswered, onConflict }) {
  const status = h("div", { class: "question-status" });
  const name = `q${(formCount += 1)}`;
  const kind = String(request.kind ?? "");
  const form = h("form", { class: "card question-form", dataset: { kind } });
  const buttons = h("div", { class: "row question-buttons" });
  const enable = (on) => {
    for (const button of form.querySelectorAll("button")) button.disabled = !on;
  };
  const send = async (response, summary) => {
    status.replaceChildren();
    enable(false);
    try {
      const path = `/assistant/chat/${encodeURIComponent(chatId)}/resume`;
      const started = await api.post(path, { request_id: request.request_id, response });
      form.replaceChildren(h("p", { class: "muted" }, `Answered: ${summary}`));
      onAnswered(started, summary);
    } catch (error) {
      if (error instanceof ApiError && error.status === 409 && onConflict) {
        onConflict(error);
        return;
      }
      status.append(notice("error", `The answer was refused: ${failure(error)}`));
      enable(true);
    }
  };
  const skip = h("button", { type: "button", class: "secondary skip" }, "Skip");
  const skipped = { kind: "skipped", reason: "skipped in the console" };
  skip.addEventListener("click", () => send(skipped, "skipped"));
  form.append(
    h("div", { class: "question-label" }, "The assistant asks"),
    h("p", { class: "question-message" }, String(request.message ?? "")),
  );
  (BUILDERS[kind] || unknownKind)({ api, request, form, buttons, name, send, status });
  buttons.append(skip);
  form.append(buttons, status);
  return form;
}

function submitButton(text = "Answer") {
  return h("button", { type: "submit", class: "answer-button" }, text);
}

function optionsOf(request) {
  return Array.isArray(request.options) ? request.options : [];
}

/** The label of the option whose value is `value` (the value when none has it). */
function labelOf(options, value) {
  const option = options.find((o) => String(o.value) === value);
  return String(option ? (option.label ?? value) : value);
}

function optionLabel(type, name, option) {
  const description = option.description
    ? h("span", { class: "muted option-description" }, ` — ${option.description}`)
    : null;
  return h(
    "label",
    { class: "option" },
    h("input", { type, name, value: String(option.value ?? "") }),
    h("span", {}, String(option.label ?? option.value ?? "")),
    description,
  );
}

const BUILDERS = {
  single_choice({ request, form, buttons, name, send, status }) {
    const options = optionsOf(request);
    form.append(h("div", { class: "options" }, options.map((o) => optionLabel("radio", name, o))));
    const free = request.allow_free_text
      ? h("input", { type: "text", class: "free-text", placeholder: "Or in your own words" })
      : null;
    if (free) form.append(h("label", {}, "Your own answer", free));
    buttons.append(submitButton());
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const picked = form.querySelector(`input[name="${name}"]:checked`);
      if (free && free.value.trim()) {
        send({ kind: "single_choice", free_text: free.value }, free.value);
      } else if (picked) {
        const answer = { kind: "single_choice", selected_value: picked.value };
        send(answer, labelOf(options, picked.value));
      } else {
        status.replaceChildren(notice("error", "Pick an option."));
      }
    });
  },

  multi_choice({ request, form, buttons, name, send, status }) {
    const options = optionsOf(request);
    const low = Number(request.min_selections) || 0;
    const high = request.max_selections == null ? options.length : Number(request.max_selections);
    const boxes = options.map((o) => optionLabel("checkbox", name, o));
    form.append(h("div", { class: "options" }, boxes));
    const pick = low === high ? `Pick ${plural(low, "option")}.` : `Pick ${low} to ${high} options.`;
    form.append(h("p", { class: "hint" }, pick));
    buttons.append(submitButton());
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const checked = form.querySelectorAll(`input[name="${name}"]:checked`);
      const values = [...checked].map((input) => input.value);
      if (values.length < low || values.length > high) {
        status.replaceChildren(notice("error", pick));
        return;
      }
      const summary = values.map((v) => labelOf(options, v)).join(", ") || "(none)";
      send({ kind: "multi_choice", selected_values: values }, summary);
    });
  },

  yes_no({ request, form, buttons, send }) {
    const yesLabel = String(request.yes_label || "Yes");
    const noLabel = String(request.no_label || "No");
    const yes = h("button", { type: "button", class: "answer-yes" }, yesLabel);
    const no = h("button", { type: "button", class: "secondary answer-no" }, noLabel);
    yes.addEventListener("click", () => send({ kind: "yes_no", answer: true }, yesLabel));
    no.addEventListener("click", () => send({ kind: "yes_no", answer: false }, noLabel));
    form.addEventListener("submit", (event) => event.preventDefault());
    buttons.append(yes, no);
  },

  free_text({ request, form, buttons, send, status }) {
    // no maxlength: it counts UTF-16 units (an emoji is two), the server counts characters
    const props = {
      class: "free-text",
      placeholder: request.placeholder ? String(request.placeholder) : null,
    };
    const input = request.multiline
      ? h("textarea", { ...props, rows: "4" })
      : h("input", { type: "text", ...props });
    form.append(h("label", {}, "Your answer", input));
    if (request.multiline) {
      form.append(h("p", { class: "hint" }, "Ctrl+Enter (⌘+Enter) sends."));
      input.addEventListener("keydown", (event) => {
        if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
      });
    }
    buttons.append(submitButton());
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const wrong = lengthProblem(input.value, request);
      if (wrong) {
        status.replaceChildren(notice("error", wrong));
        return;
      }
      send({ kind: "free_text", text: input.value }, input.value);
    });
  },

  credential_request(parts) {
    credentialForm(parts);
  },
};

/** Why free text `value` does not fit `request`'s min_length / max_length (counted in
 * characters, as the server counts them: [...value]), or null. */
function lengthProblem(value, request) {
  const least = Math.max(Number(request.min_length) || 0, 1);
  const most = Number(request.max_length) || 0;
  if ([...value.trim()].length < least) return `Write at least ${plural(least, "character")}.`;
  const length = [...value.trim()].length; // the server counts without surrounding whitespace
  if (most && length > most) {
    return `Write at most ${plural(most, "character")} (this answer has ${length.toLocaleString()}).`;
  }
  return null;
}

function unknownKind({ request, form }) {
  const text = `This question's kind (${String(request.kind)}) has no form here; you can skip it.`;
  form.append(notice("info", text));
  form.addEventListener("submit", (event) => event.preventDefault());
}

/** Whether credential `c`'s `expires_at` has passed. */
export function isExpired(c) {
  const at = c && c.expires_at ? Date.parse(c.expires_at) : NaN;
  return !Number.isNaN(at) && at <= Date.now();
}

/** The organization's credentials of `integration` (not expired) into `select` (GET /credentials). */
async function loadCredentials(api, integration, select) {
  select.replaceChildren(h("option", { value: "" }, "loading…"));
  try {
    const page = await api.get("/credentials", { integration_name: integration, limit: 100 });
    // an expired credential would fail the call: it is not offered
    const items = ((page && page.credentials) || []).filter((c) => !isExpired(c));
    const first = items.length ? "Choose a credential" : "No credential of this integration yet";
    select.replaceChildren(
      h("option", { value: "" }, first),
      ...items.map((c) =>
        h(
          "option",
          { value: String(c.credential_id) },
          `${isolate(c.display_name || c.credential_id)} (${isolate(c.auth_type)})`,
        ),
      ),
    );
  } catch {
    select.replaceChildren(h("option", { value: "" }, "The credentials cannot be listed"));
  }
}

/** credential_request: "Connect" for OAuth2 (opens the provider in a new window; the run then
 * resumes by itself and the run's view follows run_resumed), or one of the organization's
 * existing credentials of the integration, sent as credential_added. */
function credentialForm({ api, request, form, buttons, send, status }) {
  const integration = String(request.integration_name ?? "");
  const display = String(request.integration_display_name || integration);
  const options = (Array.isArray(request.auth_options) ? request.auth_options : []).filter(
    (o) => o && typeof o === "object",
  );
  form.append(h("p", { class: "hint" }, "Integration: ", text(display), " (", text(integration), ")"));
  const ways = h("div", { class: "credential-ways" });
  form.append(ways);
  if (options.some((o) => o.auth_type === "oauth2")) {
    connectOrAdd(api, integration, display, ways, status);
  } else {
    ways.append(addLink(integration, options));
  }
  const select = h("select", { class: "credential-choice" });
  const refresh = h("button", { type: "button", class: "secondary" }, "Refresh");
  refresh.addEventListener("click", () => loadCredentials(api, integration, select));
  const row = h("div", { class: "row" }, select, refresh);
  form.append(h("label", {}, "Use an existing credential", row));
  buttons.append(submitButton("Use this credential"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (!select.value) {
      status.replaceChildren(notice("error", "Choose a credential, or connect one."));
      return;
    }
    const chosen = select.selectedOptions[0];
    const answer = { kind: "credential_added", credential_id: select.value };
    answer.integration_name = integration;
    send(answer, `credential ${chosen ? chosen.textContent : select.value}`);
  });
  loadCredentials(api, integration, select);
}

/** "Add a credential" (the Credentials panel's form on `integration`), naming the accepted types. */
function addLink(integration, options) {
  const names = options.filter((o) => o.auth_type !== "oauth2").map((o) => o.display_name || o.auth_type);
  const link = h("a", { href: `#/credentials/${encodeURIComponent(integration)}`, class: "add-credential" }, "Add a credential");
  const accepted = names.length ? [" (", text(names.join(", ")), ")"] : [];
  return h("p", { class: "hint" }, link, accepted, ", then pick it below with Refresh.");
}

/** "Connect" when this deployment can connect `integration` by OAuth2 (its auth schema's
 * supports_modulex_oauth, as the Credentials panel decides), else "Add a credential". */
async function connectOrAdd(api, integration, display, box, status) {
  let detail = null;
  try {
    detail = await api.get(`/integrations/tools/${encodeURIComponent(integration)}`);
  } catch {
    detail = null; // unknown here: offer the panel, which says what it can
  }
  const schemas = (detail && Array.isArray(detail.auth_schemas) && detail.auth_schemas) || [];
  const oauth = schemas.find((s) => s.auth_type === "oauth2" && s.supports_modulex_oauth);
  if (!oauth) {
    box.append(addLink(integration, schemas));
    return;
  }
  const connect = h("button", { type: "button", class: "connect" }, `Connect ${display}`);
  connect.addEventListener("click", () => startOAuth(api, integration, status));
  const label = h("span", { class: "muted" }, text(oauth.display_name || "OAuth2"));
  box.append(h("div", { class: "row" }, connect, label));
  if (schemas.some((s) => s.auth_type !== "oauth2")) box.append(addLink(integration, schemas));
}

/** Start the OAuth2 flow and open the provider's authorization page in a new window. */
async function startOAuth(api, integration, status) {
  status.replaceChildren();
  try {
    const started = await api.post("/credentials/oauth2/initiate", {
      integration_name: integration,
      redirect_uri: `${window.location.origin}/credentials/oauth2/callback`,
    });
    const url = safeUrl(started && started.authorization_url);
    if (!url) throw new ApiError(0, "the authorization URL is not an http(s) URL");
    window.open(url, "_blank", "noopener,noreferrer");
    const link = h(
      "a",
      { href: url, target: "_blank", rel: "noopener noreferrer" },
      "Open the authorization page",
    );
    status.append(
      notice("info", "Finish in the new window: the run resumes once the credential is stored."),
      h("p", { class: "hint" }, "No window? ", link),
    );
  } catch (error) {
    const text = error instanceof ApiError ? error.detail : "The gateway cannot be reached.";
    status.append(notice("error", `Connecting failed: ${text}`));
  }
}
