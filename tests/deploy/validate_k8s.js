// Validates every object of rendered Kubernetes manifests (multi-document
// YAML files given as arguments) against the Kubernetes OpenAPI schemas, as
// compiled into the npm package kubernetes-models; offline. Exit status 0 if
// all are valid, 1 otherwise. Needs kubernetes-models and js-yaml on
// NODE_PATH (k8s_schemas_test.sh installs them).
"use strict";
const fs = require("fs");
const yaml = require("js-yaml");

// "apps/v1" + "Deployment" -> the model class; null if there is none.
function modelFor(apiVersion, kind) {
  // Core types live under "v1", others under "<group>/<version>".
  try {
    return require(`kubernetes-models/${apiVersion}/${kind}`)[kind] || null;
  } catch (e) {
    return null;
  }
}

function validate(doc) {
  if (!doc || typeof doc !== "object") return "not an object";
  const Model = modelFor(String(doc.apiVersion), String(doc.kind));
  if (!Model) return `no schema for ${doc.apiVersion} ${doc.kind}`;
  try {
    new Model(doc).validate();
    return null;
  } catch (e) {
    return e.message;
  }
}

// The validator must be able to fail: a wrong type and a missing required
// field are caught.
const broken = [
  {apiVersion: "apps/v1", kind: "Deployment", metadata: {name: "x"},
   spec: {selector: {}, template: {spec: {containers: [
     {name: "c", ports: [{containerPort: "50051"}]}]}}}},
  {apiVersion: "v1", kind: "Service", metadata: {name: "x"},
   spec: {ports: [{name: "grpc"}]}},
];
for (const doc of broken) {
  if (validate(doc) === null) {
    console.error("self-test: an invalid object validated; the schemas are " +
                  "not being applied");
    process.exit(1);
  }
}

let failed = 0;
let checked = 0;
for (const file of process.argv.slice(2)) {
  const docs = yaml.loadAll(fs.readFileSync(file, "utf8")).filter((d) => d);
  if (docs.length === 0) {
    console.error(`${file}: no objects`);
    failed++;
  }
  for (const doc of docs) {
    const what = `${file}: ${doc.kind}/${doc.metadata && doc.metadata.name}`;
    const error = validate(doc);
    checked++;
    if (error) {
      console.error(`INVALID ${what}: ${error}`);
      failed++;
    } else {
      console.log(`valid ${what} (${doc.apiVersion})`);
    }
  }
}
console.log(`${checked} objects checked, ${failed} invalid`);
process.exit(failed ? 1 : 0);
