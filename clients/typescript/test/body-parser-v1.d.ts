/** body-parser 1.x (Express 4's), installed under another name beside Express 5's 2.x; @types/body-parser describes its API. */
declare module 'body-parser-v1' {
  import bodyParser = require('body-parser');
  export = bodyParser;
}
