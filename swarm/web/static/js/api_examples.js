// Ready-made requests for the API section: one per API the pool speaks ("face") and per language, with the selected
// token and model filled in. Each is complete as shown: pasted into a shell or a file, it runs.

export const FACES = [
  ["chat", "Chat Completions"],
  ["responses", "Responses"],
  ["messages", "Anthropic Messages"],
  ["ollama", "Ollama"],
];
export const LANGUAGES = [["curl", "curl"], ["python", "Python"], ["javascript", "JavaScript"]];

const HELLO = `[{"role": "user", "content": "Hello!"}]`;
const HELLO_JS = `[{ role: "user", content: "Hello!" }]`;

function curl(url, headers, body) {
  const lines = [`curl ${url}`, ...headers.map((header) => `-H "${header}"`), `-H "Content-Type: application/json"`,
    `-d '${body}'`];
  return lines.join(" \\\n  ");
}

function fetchJs(url, headers, body, result) {
  const lines = headers.map(([name, value]) => `    "${name}": "${value}",`).join("\n");
  return `const response = await fetch("${url}", {\n  method: "POST",\n  headers: {\n${lines}\n` +
    `    "Content-Type": "application/json",\n  },\n  body: JSON.stringify(${body}),\n});\n` +
    `const data = await response.json();\nconsole.log(${result});`;
}

/** The page's generation settings as each face names them: [JSON field, Python keyword, value]. */
function params(face, settings) {
  const out = [];
  const tokens = face === "responses" ? "max_output_tokens" : "max_tokens";
  if (face !== "ollama") {
    out.push([tokens, settings.maxTokens]);
    if (settings.temperature !== null && settings.temperature !== undefined) out.push(["temperature", settings.temperature]);
  }
  return out;
}

/** Ollama puts them in "options": num_predict and temperature. */
function ollamaOptions(settings) {
  const options = { num_predict: settings.maxTokens };
  if (settings.temperature !== null && settings.temperature !== undefined) options.temperature = settings.temperature;
  return options;
}

const json = (fields) => fields.map(([key, value]) => `"${key}": ${JSON.stringify(value)}`).join(", ");
const kwargs = (fields) => fields.map(([key, value]) => `    ${key}=${JSON.stringify(value)},\n`).join("");
// anthropic's package (2.x) takes no sampling keywords: they go in extra_body
const anthropicKwargs = (fields) => {
  const sampling = fields.filter(([key]) => key !== "max_tokens");
  return kwargs(fields.filter(([key]) => key === "max_tokens")) +
    (sampling.length ? `    extra_body={${json(sampling)}},\n` : "");
};
const jsFields = (fields) => fields.map(([key, value]) => `    ${key}: ${JSON.stringify(value)},\n`).join("");

/** {curl, python, javascript} for ``face``, against this page's origin, with ``key`` and ``model`` filled in and the
 * page's max tokens and temperature (Settings > Generation). */
export function examples(face, key, model, settings) {
  const origin = location.origin;
  const bearer = [["Authorization", `Bearer ${key}`]];
  const bearerHeader = [`Authorization: Bearer ${key}`];
  const extra = params(face, settings);
  if (face === "responses") {
    return {
      curl: curl(`${origin}/v1/responses`, bearerHeader, `{"model": "${model}", "input": "Hello!", ${json(extra)}}`),
      python: `from openai import OpenAI\n\nclient = OpenAI(base_url="${origin}/v1", api_key="${key}")\n` +
        `response = client.responses.create(\n    model="${model}",\n    input="Hello!",\n${kwargs(extra)})\n` +
        `print(response.output_text)`,
      javascript: fetchJs(`${origin}/v1/responses`, bearer, `{\n    model: "${model}",\n    input: "Hello!",\n${jsFields(extra)}  }`,
        `data.output.filter((item) => item.type === "message")\n  .flatMap((item) => item.content).map((part) => part.text).join("")`),
    };
  }
  if (face === "messages") {
    const headers = [["x-api-key", key], ["anthropic-version", "2023-06-01"]];
    return {
      curl: curl(`${origin}/v1/messages`, headers.map(([name, value]) => `${name}: ${value}`),
        `{"model": "${model}", ${json(extra)},\n       "messages": ${HELLO}}`),
      python: `import anthropic\n\nclient = anthropic.Anthropic(base_url="${origin}", api_key="${key}")\n` +
        `message = client.messages.create(\n    model="${model}",\n    messages=${HELLO},\n${anthropicKwargs(extra)})\n` +
        `print("".join(block.text for block in message.content if block.type == "text"))`,
      javascript: fetchJs(`${origin}/v1/messages`, headers,
        `{\n    model: "${model}",\n    messages: ${HELLO_JS},\n${jsFields(extra)}  }`,
        `data.content.filter((block) => block.type === "text").map((block) => block.text).join("")`),
    };
  }
  if (face === "ollama") {
    const options = JSON.stringify(ollamaOptions(settings)).replaceAll(",", ", ").replaceAll(":", ": ");
    return {
      curl: curl(`${origin}/api/chat`, bearerHeader,
        `{"model": "${model}", "stream": false, "options": ${options},\n       "messages": ${HELLO}}`),
      python: `from ollama import Client\n\nclient = Client(host="${origin}", headers={"Authorization": "Bearer ${key}"})\n` +
        `response = client.chat(\n    model="${model}",\n    messages=${HELLO},\n    options=${options},\n)\n` +
        `print(response.message.content)`,
      javascript: fetchJs(`${origin}/api/chat`, bearer,
        `{\n    model: "${model}",\n    stream: false,\n    options: ${options},\n    messages: ${HELLO_JS},\n  }`,
        "data.message.content"),
    };
  }
  return {
    curl: curl(`${origin}/v1/chat/completions`, bearerHeader,
      `{"model": "${model}", "stream": true, ${json(extra)},\n       "messages": ${HELLO}}`),
    python: `from openai import OpenAI\n\nclient = OpenAI(base_url="${origin}/v1", api_key="${key}")\n` +
      `stream = client.chat.completions.create(\n    model="${model}",\n    messages=${HELLO},\n${kwargs(extra)}    stream=True,\n)\n` +
      `for chunk in stream:\n    print(chunk.choices[0].delta.content or "", end="", flush=True)`,
    javascript: fetchJs(`${origin}/v1/chat/completions`, bearer,
      `{\n    model: "${model}",\n    messages: ${HELLO_JS},\n${jsFields(extra)}  }`, "data.choices[0].message.content"),
  };
}
